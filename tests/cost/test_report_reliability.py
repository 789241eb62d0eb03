"""Issue 12, the report: every number of every input is checked before anything is drawn (one line
naming the file and the field), and a report folder is published whole: a failure or a crash at any
moment leaves the old report or the new one, never a mix, and no leftover blocks the next run.

Inputs are written here, from the recorded real bench result (tests/fixtures/report) with one
field changed per case. In-process through `neuron_train.cli.main`, except the kill -9 case.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_train import cli
from neuron_train.common.fileio import LISTED, work_path
from neuron_train.cost.report import charts
from neuron_train.cost.report import folder as report_folder
from neuron_train.cost.report.folder import OUTPUT_FILES
from tests.conftest import ROOT
from tests.fullfs import fill, mounted_tmpfs

REPORT = sorted((*OUTPUT_FILES, LISTED))  # the report and its list of what the folder holds

INFER = json.loads((ROOT / "tests" / "fixtures" / "report" / "cpu_infer_vit_digits.json").read_text())


@pytest.fixture(autouse=True)
def _no_aws(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))


def result(tmp_path: Path, name: str = "r.json", instance: str = "trn1.2xlarge", **changes) -> Path:
    """The real result with `changes` applied ('a__b' sets r['a']['b'])."""
    r = copy.deepcopy(INFER)
    r["instance_type"] = instance
    for dotted, value in changes.items():
        node = r
        *parents, last = dotted.split("__")
        for key in parents:
            node = node[key]
        node[last] = value
    path = tmp_path / name
    path.write_text(json.dumps(r))  # NaN and Infinity written as JSON readers accept them
    return path


def report(capsys, *argv) -> tuple[int, str]:
    code = cli.main(["report", *map(str, argv)])
    err = capsys.readouterr().err
    if code:
        assert err.count("\n") == 1 and "Traceback" not in err, err
    return code, err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture
def old_report(tmp_path, capsys) -> Path:
    out = tmp_path / "rep"
    assert report(capsys, result(tmp_path, "old.json"), "--out", out)[0] == 0
    assert sorted(snapshot(out)) == REPORT
    return out


# ----------------------------------------------------------------------------- every number, before drawing


SWEEP_OK = {"batch_size_per_device": 32, "world_size": 1, "status": "ok", "reason": "", "samples_per_sec": 150.0,
            "step_time_ms": 213.0, "compile_time_s": 3.0, "graph_count": 1}


@pytest.mark.parametrize("changes, field", [
    ({"samples_per_sec__spread": float("nan")}, "'samples_per_sec.spread' must be a finite number >= 0, got nan"),
    ({"samples_per_sec__median": float("inf")}, "'samples_per_sec.median' must be a finite number > 0, got inf"),
    ({"samples_per_sec__spread": -5.0}, "'samples_per_sec.spread' must be a finite number >= 0"),
    ({"step_time_ms__spread": -0.1}, "'step_time_ms.spread' must be a finite number >= 0"),
    ({"compile__time_s": -1.0}, "'compile.time_s' must be a finite number >= 0"),
    ({"compile__graph_count": -1}, "'compile.graph_count' must be an integer >= 0"),
    ({"dataset__train_samples": -10}, "'dataset.train_samples' must be an integer >= 1"),
    ({"measured_steps": 0}, "'measured_steps' must be an integer >= 1"),
    ({"repeats": "3"}, "'repeats' must be an integer >= 1, got '3'"),
    ({"samples_per_sec__values": ["a", "b", "c"]}, "'samples_per_sec.values' must be a list of finite numbers > 0"),
    ({"step_time_ms__values": [1.0, float("nan"), 2.0]}, "'step_time_ms.values' must be a list of finite numbers"),
    ({"host__load_average_1m": "high"}, "'host.load_average_1m' must be a finite number >= 0 or null"),
    ({"sweep": [{**SWEEP_OK, "samples_per_sec": "fast"}]}, "'sweep[0].samples_per_sec' must be a finite number > 0"),
    ({"sweep": [SWEEP_OK, {**SWEEP_OK, "compile_time_s": float("-inf")}]}, "'sweep[1].compile_time_s' must be"),
    ({"sweep": [{k: v for k, v in SWEEP_OK.items() if k != "samples_per_sec"}]},
     "missing field 'sweep[0].samples_per_sec'"),
    ({"sweep": [{**SWEEP_OK, "status": "great"}]}, "'sweep[0].status' must be one of ok, oom, failed"),
    ({"sweep": ["row"]}, "'sweep[0]' must be a JSON object"),
])
def test_every_number_is_checked_before_anything_is_drawn(tmp_path, capsys, monkeypatch, changes, field):
    monkeypatch.setattr(charts, "render_charts", lambda *a: pytest.fail("drew charts from a bad input"))
    bad = result(tmp_path, "bad.json", **changes)
    code, err = report(capsys, result(tmp_path, "good.json"), bad, "--out", tmp_path / "rep")
    assert code == 2 and f"{bad}: " in err and field in err
    assert not (tmp_path / "rep").exists() and leftovers(tmp_path) == []


def test_a_failed_sweep_row_needs_no_figures(tmp_path, capsys):
    oom = {"batch_size_per_device": 64, "world_size": 1, "status": "oom", "reason": "RESOURCE_EXHAUSTED"}
    assert report(capsys, result(tmp_path, sweep=[SWEEP_OK, oom]), "--out", tmp_path / "rep")[0] == 0


@pytest.mark.parametrize("name, content, message", [
    ("prices.yaml", b"prices:\n- instance_type: local\n  source: caf\xe9\n", "not UTF-8 text (byte 0xe9"),
    ("prices.json", b'{"prices": [{"source": "caf\xe9"}]}', "not UTF-8 text (byte 0xe9"),
    ("prices.csv", b"instance_type,usd_per_hour,region,date,source\nlocal,1,r,2026-01-01,caf\xe9\n",
     "not UTF-8 text (byte 0xe9"),
    ("prices.csv", b"instance_type,usd_per_hour,region,date,source\ntrn1.2xlarge,nan,r,2026-01-01,me\n",
     "usd_per_hour must be a finite number > 0, got 'nan'"),
    ("prices.yaml", b"prices:\n- {instance_type: trn1.2xlarge, usd_per_hour: .inf, region: r, date: d, source: s}\n",
     "usd_per_hour must be a finite number > 0"),
])
def test_bad_price_files_are_one_line(tmp_path, capsys, name, content, message):
    prices = tmp_path / name
    prices.write_bytes(content)
    code, err = report(capsys, result(tmp_path), "--prices", prices, "--out", tmp_path / "rep")
    assert code == 2 and str(prices) in err and message in err
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("content, message", [
    (b"Model,Inst. Type,Throughput (inference/sec)\nvit caf\xe9,inf2.xlarge,100\n", "not UTF-8 text (byte 0xe9"),
    (b"Model,Inst. Type,Throughput (inference/sec)\nvit,inf2.xlarge,nan\n", ":2: throughput is not a positive number"),
    (b"Model,Inst. Type,Throughput (inference/sec)\nvit,inf2.xlarge,Infinity\n", ":2: throughput is not a positive"),
    (b"Model,Inst. Type,Throughput (inference/sec),Batch Size\nvit,inf2.xlarge,10,-4\n", ":2: batch size must be > 0"),
    (b"Model,Instance-Type,Performance [seq/sec],Nodes\nvit,trn1.32xlarge,10,-2\n", ":2: Nodes must be >= 1"),
])
def test_bad_reference_tables_are_one_line(tmp_path, capsys, content, message):
    table = tmp_path / "ref.csv"
    table.write_bytes(content)
    code, err = report(capsys, "--reference", table, "--out", tmp_path / "rep")
    assert code == 2 and str(table) in err and message in err


def test_a_result_that_is_a_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "r.json").mkdir()
    code, err = report(capsys, tmp_path / "r.json", "--out", tmp_path / "rep")
    assert code == 2 and "is a directory, not a regular file" in err


# ----------------------------------------------------------------------------- the folder, whole


def test_a_failure_half_way_keeps_the_old_report_whole(tmp_path, capsys, monkeypatch, old_report):
    """The charts are drawn, then rendering fails: nothing of the new report reaches the folder."""
    before = snapshot(old_report)
    def broken(*args):
        raise RuntimeError("renderer crashed")

    monkeypatch.setattr(report_folder, "render_html", broken)
    with pytest.raises(RuntimeError, match="renderer crashed"):
        report(capsys, result(tmp_path, "new.json", instance="inf2.xlarge"), "--out", old_report, "--force")
    assert snapshot(old_report) == before and leftovers(tmp_path) == []
    monkeypatch.undo()
    assert report(capsys, result(tmp_path, "new.json", instance="inf2.xlarge"), "--out", old_report,
                  "--force")[0] == 0
    after = snapshot(old_report)
    assert sorted(after) == REPORT and all(after[n] != before[n] for n in OUTPUT_FILES)
    assert leftovers(tmp_path) == []


def test_a_full_disk_while_publishing_keeps_the_old_report_whole(tmp_path, capsys, monkeypatch, old_report):
    before = snapshot(old_report)
    synced = []

    def fsync_until_full(fd):
        synced.append(fd)
        if len(synced) == 3:  # the third file of the new report
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync_until_full)
    code, err = report(capsys, result(tmp_path, "new.json", instance="inf2.xlarge"), "--out", old_report, "--force")
    assert code == 1 and "no space left" in err and "kept" in err  # one line: report() checks it
    assert snapshot(old_report) == before and leftovers(tmp_path) == []


def test_a_really_full_disk_is_one_line_and_keeps_the_old_report(tmp_path, capsys):
    """A tmpfs that really fills up (no fault injected): report --force over an existing report."""
    with mounted_tmpfs(tmp_path / "small", size="4m") as small:
        out = small / "rep"
        assert report(capsys, result(tmp_path, "old.json"), "--out", out)[0] == 0
        before = snapshot(out)
        fill(small)
        code, err = report(capsys, result(tmp_path, "new.json", instance="inf2.xlarge"), "--out", out, "--force")
        assert code == 1 and "no space left on the device of" in err and "Traceback" not in err
        assert snapshot(out) == before and leftovers(small) == []


KILL_AT_SWAP = """
import os, signal, sys
from neuron_train.common import fileio
real_rename = os.rename
def rename_then_die(src, dst):
    real_rename(src, dst)
    if ".old-" in os.fspath(dst):   # the old report moved aside, the new one not yet in place
        os.kill(os.getpid(), signal.SIGKILL)
fileio.os.rename = rename_then_die
from neuron_train import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_run_killed_mid_swap_leaves_the_old_report_and_blocks_nothing(tmp_path, capsys, old_report):
    before = snapshot(old_report)
    new = result(tmp_path, "new.json", instance="inf2.xlarge")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_EC2_METADATA_DISABLED": "true"}
    proc = subprocess.run([sys.executable, "-c", KILL_AT_SWAP, "report", str(new), "--out", str(old_report),
                           "--force"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert not old_report.exists() and [n for n in leftovers(tmp_path) if ".old-" in n]  # the worst moment
    code, err = report(capsys, new, "--out", old_report)  # no --force: the old report is back, and kept
    assert code == 2 and "already holds a report" in err
    assert snapshot(old_report) == before and leftovers(tmp_path) == []
    assert report(capsys, new, "--out", old_report, "--force")[0] == 0
    assert snapshot(old_report) != before


def test_a_dead_runs_half_built_folder_is_removed(tmp_path, capsys):
    out = tmp_path / "rep"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    ours = work_path(out, "building")
    stale = ours.with_name(ours.name.rsplit("-", 1)[0] + f"-{dead.pid}")
    stale.mkdir()
    (stale / "throughput.png").write_bytes(b"half")
    assert report(capsys, result(tmp_path), "--out", out)[0] == 0
    assert leftovers(tmp_path) == [] and sorted(snapshot(out)) == REPORT


def test_a_folder_with_other_files_is_refused_and_untouched(tmp_path, capsys):
    out = tmp_path / "rep"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "report.md").write_text("my report")
    for force in ([], ["--force"]):
        code, err = report(capsys, result(tmp_path), "--out", out, *force)
        assert code == 2 and "holds files that are not part of a report (notes.txt)" in err
    assert snapshot(out) == {"notes.txt": b"mine", "report.md": b"my report"}


def test_a_linked_report_folder_is_refused(tmp_path, capsys):
    (tmp_path / "real").mkdir()
    (tmp_path / "rep").symlink_to(tmp_path / "real")
    code, err = report(capsys, result(tmp_path), "--out", tmp_path / "rep", "--force")
    assert code == 2 and "is a symbolic link" in err and list((tmp_path / "real").iterdir()) == []
