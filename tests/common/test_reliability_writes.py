"""Issue 42 (reliability round 5), item 1: writes that followed links or replaced what is not ours.
Each bad row of the attack matrix, in-process: one line and a non-zero exit (or the work done
beside what is kept), and nothing of the user's changed. Each test was seen failing with its rule
in common/writer.py (or its caller) removed."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from neuron_train import cli
from neuron_train.common import fileio
from neuron_train.common.errors import RunError
from neuron_train.precompile import maintenance, store
from neuron_train.training import rundir
from neuron_train.training.metrics import MetricsWriter
from tests.conftest import FAST, NANO
from tests.cost.test_report_reliability import result
from tests.precompile.test_reliability_cache import make_cache, manifest_json, record
from tests.training.test_reliability_files import within
from tests.training.test_reliability_train import run_cfg, save_checkpoint


@pytest.fixture(autouse=True)
def _clean_env(in_process_cli, monkeypatch):
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def cli_run(capsys, *argv) -> tuple[int, str]:
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    if code:
        assert err.count("\n") == 1 and "Traceback" not in err, err
    return code, err


def plant(path: Path, kind: str, notes: Path) -> None:
    """A link to the user's notes, a FIFO, a directory holding a file, or a device node."""
    if kind == "link":
        path.symlink_to(notes)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    else:
        path.mkdir()
        (path / "thesis.tex").write_text("chapter 1")


@pytest.fixture
def notes(tmp_path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("the user's notes\n")
    return path


# ----------------------------------------------------------------------------- the run folder's own files


@pytest.mark.parametrize("kind", ["link", "fifo", "dir"])
@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "summary.json", "config.yaml"])
def test_a_run_file_that_is_a_link_fifo_or_folder_is_refused_before_training(tmp_path, notes, kind, name):
    out = tmp_path / "run"
    save_checkpoint(out, 2)
    plant(out / name, kind, notes)
    with pytest.raises(RunError, match=rf"{name} is (a symbolic link|a named pipe|a directory).*move it away") as err:
        within(60, lambda: rundir.preflight(run_cfg(out, "--max-steps", "4", "--resume")))
    assert "\n" not in str(err.value)
    assert notes.read_text() == "the user's notes\n"  # not truncated, no pid written into it


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_train_with_a_lock_or_metrics_file_not_ours_is_one_line_and_exit_1(tmp_path, capsys, notes, kind):
    """The command as the user runs it (in-process: refused before torch_xla starts)."""
    out = tmp_path / "run"
    save_checkpoint(out, 2)
    plant(out / (".lock" if kind == "link" else "metrics.jsonl"), kind, notes)
    code, err = within(60, lambda: cli_run(capsys, "train", "--output-dir", out, *NANO, *FAST, "--max-steps", "4",
                                           "--resume"))
    assert code == 1 and "move it away and run again (nothing was written)" in err
    assert notes.read_text() == "the user's notes\n"


@pytest.mark.parametrize("kind", ["link", "fifo", "dir"])
def test_the_lock_itself_never_opens_a_link_or_a_fifo(tmp_path, notes, kind):
    """The lock's own rule (common.writer.open_lock), whatever the checks before it said."""
    out = tmp_path / "run"
    out.mkdir()
    plant(out / ".lock", kind, notes)
    with pytest.raises(RunError, match=r"\.lock is .*not the run's lock file"):
        within(60, lambda: rundir.hold_lock(out))
    assert notes.read_text() == "the user's notes\n"


def test_a_dangling_lock_link_creates_nothing_where_it_points(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").symlink_to(tmp_path / "elsewhere.txt")
    with pytest.raises(RunError, match="is a symbolic link"):
        rundir.hold_lock(out)
    assert not (tmp_path / "elsewhere.txt").exists()


@pytest.mark.parametrize("kind", ["file", "link"])
def test_checkpoints_that_is_a_file_or_a_link_is_refused_before_training(tmp_path, kind):
    out = tmp_path / "run"
    save_checkpoint(out, 2)
    real = out / "checkpoints"
    real.rename(tmp_path / "elsewhere")
    if kind == "file":
        real.write_text("not a folder")
    else:
        real.symlink_to(tmp_path / "elsewhere")
    (out / "metrics.jsonl").write_text("")
    with pytest.raises(RunError, match=r"checkpoints is (a file|a symbolic link), not the folder of the run's "
                                       r"checkpoints"):
        rundir.preflight(run_cfg(out, "--max-steps", "4", "--resume"))


def test_a_checkpoint_or_checksum_that_is_a_fifo_is_refused_before_training(tmp_path):
    out = tmp_path / "run"
    path = save_checkpoint(out, 2)
    sidecar = path.with_name(path.name + ".sha256")
    sidecar.unlink()
    os.mkfifo(sidecar)
    with pytest.raises(RunError, match=r"\.sha256 is a named pipe \(FIFO\), not the checkpoint file"):
        within(60, lambda: rundir.preflight(run_cfg(out, "--max-steps", "4", "--resume")))


def test_a_save_never_writes_through_a_checkpoints_link(tmp_path):
    from neuron_train.training import checkpoint as ckpt
    from tests.training.test_checkpoint import state

    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(outside)
    with pytest.raises(RunError, match=r"checkpoints is a symbolic link, not a folder: refusing to write through it"):
        ckpt.save(tmp_path / "run", 2, state(2), keep_last=3)
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("name", ["step-00000002.pt", "step-00000002.pt.sha256"])
def test_a_save_never_replaces_a_fifo_by_a_checkpoints_name(tmp_path, name):
    """A FIFO made by a checkpoint's name after the checks: the save is one line, the FIFO kept."""
    from neuron_train.training import checkpoint as ckpt
    from tests.training.test_checkpoint import state

    folder = ckpt.checkpoint_dir(tmp_path / "run")
    folder.mkdir(parents=True)
    os.mkfifo(folder / name)
    with pytest.raises(RunError, match=rf"{name} is a named pipe \(FIFO\), not the (checkpoint|checksum file)"):
        ckpt.save(tmp_path / "run", 2, state(2), keep_last=3)
    assert stat.S_ISFIFO((folder / name).lstat().st_mode)
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary file left


@pytest.mark.parametrize("resume_step", [None, 5])
def test_appending_to_a_hard_linked_metrics_file_leaves_the_other_copy_alone(tmp_path, resume_step):
    """`cp -al orig run`, then `train --resume` in run: the original's metrics.jsonl must not grow."""
    orig, run = tmp_path / "orig", tmp_path / "run"
    orig.mkdir()
    run.mkdir()
    lines = "".join(json.dumps({"kind": "train", "step": s, "loss": 1.0}) + "\n" for s in range(3))
    (orig / "metrics.jsonl").write_text(lines)
    os.link(orig / "metrics.jsonl", run / "metrics.jsonl")
    metrics = MetricsWriter(run, tensorboard=False, resume_step=resume_step)
    metrics.write(3, {"loss": 0.5})
    metrics.close()
    assert (orig / "metrics.jsonl").read_text() == lines
    assert (run / "metrics.jsonl").read_text().count("\n") == 4
    assert os.stat(run / "metrics.jsonl").st_nlink == 1


@pytest.mark.parametrize("kind", ["fifo", "dir", "link"])
def test_a_metrics_file_that_is_not_a_regular_file_is_one_line_not_a_hang(tmp_path, notes, kind):
    run = tmp_path / "run"
    run.mkdir()
    plant(run / "metrics.jsonl", kind, notes)
    with pytest.raises(RunError, match="metrics.jsonl is .*not the run's metrics.jsonl"):
        within(60, lambda: MetricsWriter(run, tensorboard=False, resume_step=2))
    assert notes.read_text() == "the user's notes\n"


def test_resume_removes_only_the_temporary_names_we_make(tmp_path):
    from neuron_train.training import checkpoint as ckpt

    out = tmp_path / "run"
    save_checkpoint(out, 2)
    ours, theirs = out / ".summary.json.k2x9_abc.tmp", out / ".thesis.tex.swp.tmp"
    ours.write_text("half")
    theirs.write_text("the user's editor")
    assert ckpt.remove_stale_temps(out) == [ours]
    assert theirs.read_text() == "the user's editor"


# ----------------------------------------------------------------------------- report, plan, bench, check-graphs


def test_report_force_never_deletes_what_is_inside_an_entry_by_a_reports_name(tmp_path, capsys):
    out = tmp_path / "rep"
    assert cli_run(capsys, "report", result(tmp_path), "--out", out)[0] == 0
    (out / "report.md").unlink()
    plant(out / "report.md", "dir", tmp_path)
    code, err = cli_run(capsys, "report", result(tmp_path), "--out", out, "--force")
    assert code == 2 and "not part of a report (report.md)" in err
    assert (out / "report.md" / "thesis.tex").read_text() == "chapter 1"


def test_an_old_report_folder_is_deleted_entry_by_entry_keeping_what_appeared_in_it(tmp_path, capsys, monkeypatch):
    """Between the check and the swap a file appears in the old folder: it is kept, not deleted."""
    from neuron_train.cost.report import folder as report_folder

    out = tmp_path / "rep"
    assert cli_run(capsys, "report", result(tmp_path), "--out", out)[0] == 0
    real = report_folder.publish_folder

    def late(folder, files, known=()):
        (folder / "thesis.tex").write_text("chapter 1")  # the user saved it there meanwhile
        return real(folder, files, known)

    monkeypatch.setattr(report_folder, "publish_folder", late)
    assert cli_run(capsys, "report", result(tmp_path), "--out", out, "--force")[0] == 0
    (old,) = [p for p in tmp_path.iterdir() if ".rep.old-" in p.name]
    assert [p.name for p in old.iterdir()] == ["thesis.tex"]


def test_report_out_dot_is_refused_and_the_current_folder_untouched(tmp_path, capsys, monkeypatch):
    here = tmp_path / "work"
    here.mkdir()
    (here / "thesis.tex").write_text("chapter 1")
    inputs = result(tmp_path)
    monkeypatch.chdir(here)
    for out in (".", "..", str(here)):
        code, err = cli_run(capsys, "report", inputs, "--out", out, "--force")
        assert code == 2 and "is the current folder or holds it" in err
    assert [p.name for p in here.iterdir()] == ["thesis.tex"]


@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("command", [["plan", "--model", "vit-nano"], ["bench", "--mode", "train"]])
def test_force_never_replaces_a_device_or_a_fifo(tmp_path, capsys, kind, command):
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root")
    node = tmp_path / "node"
    plant(node, kind, tmp_path)
    code, err = cli_run(capsys, *command, "--output", node, "--force")
    assert code == 2 and "only a regular file is ever replaced (--force too)" in err
    assert stat.S_ISCHR(node.lstat().st_mode) if kind == "device" else stat.S_ISFIFO(node.lstat().st_mode)


def test_check_graphs_json_in_proc_is_refused_before_the_command_runs(tmp_path, capsys):
    marker = tmp_path / "ran"
    code, err = cli_run(capsys, "check-graphs", "--json", "/proc/x.json", "--", "touch", marker)
    assert code == 2 and "--json: cannot write in /proc: /proc is a kernel file system" in err and not marker.exists()


@pytest.mark.parametrize("replace", [False, True])
def test_an_output_that_appears_while_the_command_runs_is_kept_and_ours_goes_beside(tmp_path, capsys, replace):
    out = tmp_path / "plan.json"
    if replace:
        out.write_text("old result, --force")
    target = fileio.new_output(out, "--output", replace=replace)
    out.unlink(missing_ok=True)
    out.write_text("the user's file, written meanwhile")  # another inode: not what was probed
    written = fileio.write_json_or_print(target, {"results": []}, "hint")
    assert out.read_text() == "the user's file, written meanwhile"
    assert written == tmp_path / "plan-1.json" and json.loads(written.read_text()) == {"results": []}
    assert f"{out} appeared or changed while this command ran: it is kept; the output is {written}" in \
        capsys.readouterr().err


def test_force_replaces_the_regular_file_probed_up_front(tmp_path):
    out = tmp_path / "plan.json"
    out.write_text("old result")
    target = fileio.new_output(out, "--output", replace=True)
    assert fileio.write_json_or_print(target, {"results": []}, "hint") == out
    assert json.loads(out.read_text()) == {"results": []} and sorted(os.listdir(tmp_path)) == ["plan.json"]


# ----------------------------------------------------------------------------- the compile cache


def test_quarantine_never_moves_a_file_through_a_link_outside_the_cache(tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    cache = make_cache(tmp_path / "cache", {"xla/1": b"ok"}, manifest_json({"xla/1": record(b"other")}))
    (cache / maintenance.QUARANTINE_DIR).symlink_to(outside)
    code, err = cli_run(capsys, "cache", "verify", "--cache-dir", cache, "--quarantine")
    assert code == 1 and "quarantine is a symbolic link, not a folder" in err
    assert list(outside.iterdir()) == [] and (cache / "xla" / "1").read_bytes() == b"ok"


def test_a_dangling_manifest_lock_link_creates_no_file_outside_the_cache(tmp_path, capsys):
    cache = make_cache(tmp_path / "cache", {"xla/1": b"ok"})
    (cache / store.MANIFEST_LOCK).symlink_to(tmp_path / "created-outside")
    code, err = cli_run(capsys, "cache", "prune", "--cache-dir", cache, "--max-size", "0")
    assert code == 1 and "is a symbolic link, not the cache's lock file" in err
    assert not (tmp_path / "created-outside").exists()
