"""Issue 31 (reliability round 4), in-process: each bad row fixed as a rule, and the mutants of the
round-4 review (each test here was seen failing with its rule removed; docs/reliability.md)."""

from __future__ import annotations

import errno
import json
import os
import tarfile
import time
from pathlib import Path

import pytest

from neuron_train.common import reader
from neuron_train.precompile import store
from tests.precompile.test_reliability_cache import MODULE, make_cache, manifest_json, one_line, record, run

OLD = time.time() - 90 * 86400


def age(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        os.utime(p, (OLD, OLD), follow_symlinks=False)


def compiled_entry(module: str = MODULE) -> dict[str, bytes]:
    return {f"{module}/model.neff": b"neff", f"{module}/model.done": b"", f"{module}/model.hlo_module.pb": b"hlo",
            f"{module}/compile_flags.json": b"[]"}


# ----------------------------------------------------------------------------- cache prune


@pytest.mark.parametrize("how", ["relative", "symlink"])
def test_prune_of_a_neuron_cache_given_as_a_relative_or_linked_path_deletes_its_entries(tmp_path, capsys,
                                                                                        monkeypatch, how):
    """Bad row 1: `relative_to` crashed on every MODULE_ entry after printing `delete`."""
    real = make_cache(tmp_path / "real", compiled_entry(), manifest_json({}))
    age(real)
    if how == "relative":
        monkeypatch.chdir(tmp_path)
        given: str | Path = "real"
    else:
        given = tmp_path / "link"
        given.symlink_to(real)
    code, out, err = run(capsys, "cache", "prune", "--cache-dir", given, "--older-than", "1d")
    assert code == 0 and f"delete {MODULE}" in out, err
    assert not (real / MODULE).exists()


def test_a_compiler_artifact_name_deeper_than_a_module_folder_is_not_vouched_for(tmp_path, capsys):
    """Mutant: compiler-artifact names vouched for at any depth. `MODULE_x/sub/model.neff` is not
    what the compiler writes: the entry is kept, whole."""
    cache = make_cache(tmp_path / "c", compiled_entry(), manifest_json({}))
    (cache / MODULE / "sub").mkdir()
    (cache / MODULE / "sub" / "model.neff").write_bytes(b"someone's file")
    age(cache)
    code, out, _ = run(capsys, "cache", "prune", "--cache-dir", cache, "--older-than", "1d")
    assert code == 0 and "kept 1 entry" in out
    assert (cache / MODULE / "sub" / "model.neff").read_bytes() == b"someone's file"
    assert (cache / MODULE / "model.neff").exists()


@pytest.mark.parametrize("lock", [store.USE_LOCK, store.MANIFEST_LOCK])
def test_one_of_our_lock_files_beside_other_files_does_not_make_a_folder_a_cache(tmp_path, capsys, lock):
    """Mutant: a folder counted as a cache when any (not every) file in it is one of ours."""
    d = tmp_path / "d"
    (d / "xla").mkdir(parents=True)
    (d / "xla" / "thesis.tex").write_text("x\n")
    (d / lock).write_text("")
    age(d)
    code, _, err = run(capsys, "cache", "prune", "--cache-dir", d, "--older-than", "0s")
    assert code == 2 and "is not a compile cache" in one_line(err)
    assert (d / "xla" / "thesis.tex").read_text() == "x\n"


def test_our_lock_files_alone_are_an_empty_cache(tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    (d / store.USE_LOCK).write_text("")
    code, out, err = run(capsys, "cache", "prune", "--cache-dir", d, "--older-than", "0s")
    assert code == 0, err


# ----------------------------------------------------------------------------- EDQUOT


def test_a_quota_exceeded_is_a_full_disk_in_every_writer(tmp_path):
    """Mutant: EDQUOT (a user's disk quota) not treated as a full disk (common/fileio.py,
    training/checkpoint.py; precompile/archive.py: the next test)."""
    from neuron_train.common.fileio import write_failed
    from neuron_train.training.checkpoint import write_failed_in_run

    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    (tmp_path / "checkpoints").mkdir()
    assert str(write_failed(tmp_path / "f.json", quota)).startswith("no space left on the device of")
    line = str(write_failed_in_run(tmp_path, tmp_path / "checkpoints" / "step-00000001.pt", quota))
    assert line.startswith(f"no space left on {tmp_path / 'checkpoints'}") and "--resume" in line


def test_a_quota_exceeded_while_unpacking_is_a_full_disk(tmp_path, capsys, monkeypatch):
    from tests.precompile.test_reliability_cache import make_archive

    arc = make_archive(tmp_path / "a.tar.gz", {store.MANIFEST: json.dumps(manifest_json(
        {"xla/1": record(b"g")})).encode(), "xla/1": b"g"})

    def no_quota(*args, **kwargs):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(tarfile.TarFile, "extract", no_quota)  # archive._extract_verified's write
    code, _, err = run(capsys, "cache", "unpack", arc, "--cache-dir", tmp_path / "c")
    assert code == 1 and "no space left on the device" in one_line(err)


# ----------------------------------------------------------------------------- special files


def special_files(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    return {"fifo": fifo, "device": Path("/dev/zero"), "directory": folder}


def test_the_reader_refuses_what_is_not_a_regular_file_without_blocking(tmp_path):
    """Bad row 8: a FIFO (no writer: an open or read would block for ever), a device (endless
    bytes), a directory: each one line, at once."""
    for kind, path in special_files(tmp_path).items():
        started = time.monotonic()
        with pytest.raises(reader.UsageError, match="not a regular file"):
            reader.read_bytes(path, "--config")
        assert time.monotonic() - started < 5, kind


def test_the_reader_refuses_a_file_larger_than_its_bound(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2000)
    with pytest.raises(reader.UsageError, match="2,000 bytes, more than any such file"):
        reader.read_bytes(big, "--prices", limit=1000)


# ----------------------------------------------------------------------------- report: origins


def plan_file(tmp_path: Path, *rows: dict) -> Path:
    from neuron_train.cost.plan_result import PLAN_SCHEMA, PLAN_VERSION

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"schema": PLAN_SCHEMA, "schema_version": PLAN_VERSION, "results": list(rows)}))
    return path


def estimate(**block) -> dict:
    from tests.cost.test_report_reliability import INFER

    return {**INFER, "instance_type": "trn1.2xlarge", "source": "estimated",
            "estimate": {"bottleneck_text": "device compute", "calibration": "published", "band": [90.0, 110.0],
                         **block}}


def report_line(capsys, *argv) -> tuple[int, str]:
    from neuron_train import cli

    code = cli.main(["report", *map(str, argv)])
    err = capsys.readouterr().err
    assert err.count("\n") <= 1 and "Traceback" not in err, err
    return code, err


@pytest.mark.parametrize("row, message", [
    ({k: v for k, v in estimate().items() if k != "estimate"}, "missing field 'estimate'"),
    (estimate(band="90-110"), "field 'estimate.band'"),
    (estimate(band=[110.0, 90.0]), "low <= high"),
    (estimate(band=[float("nan"), 9.0]), "field 'estimate.band.0'"),
    (estimate(calibration=None), "field 'estimate.calibration'"),
    ({**estimate(), "source": "guessed"}, "field 'source' must be one of measured, estimated"),
])
def test_an_estimate_must_say_how_it_was_estimated(tmp_path, capsys, row, message):
    """Bad row 4: `report` trusted `"source": "estimated"` (KeyError, ValueError)."""
    code, err = report_line(capsys, plan_file(tmp_path, row), "--out", tmp_path / "rep")
    assert code == 2 and message in err
    assert not (tmp_path / "rep").exists()


def test_each_rows_origin_must_be_its_files_kind(tmp_path, capsys):
    """A plan file holds estimates only; an estimate comes only in a plan file."""
    from tests.cost.test_report_reliability import INFER

    measured = {**INFER, "instance_type": "trn1.2xlarge"}
    code, err = report_line(capsys, plan_file(tmp_path, estimate(), measured), "--out", tmp_path / "rep")
    assert code == 2 and "results[1]: a plan file holds estimates only" in err
    alone = tmp_path / "estimate.json"
    alone.write_text(json.dumps(estimate()))
    code, err = report_line(capsys, alone, "--out", tmp_path / "rep")
    assert code == 2 and "an estimate outside a plan file" in err
    code, err = report_line(capsys, plan_file(tmp_path, estimate()), "--out", tmp_path / "rep")
    assert code == 0 and "ESTIMATE" in (tmp_path / "rep" / "report.md").read_text()


# ----------------------------------------------------------------------------- outputs probed up front


@pytest.mark.parametrize("command", ["plan", "bench"])
def test_an_output_the_kernel_will_not_create_is_refused_before_measuring(tmp_path, capsys, monkeypatch, command):
    """Bad row 5 (plan's part): `--output /proc/plan.json` passed every permission check (root) and
    failed with a traceback after the measurement. Now a file is created and removed up front."""
    from neuron_train.cost import plan_measure
    from neuron_train.cost import sweep as bench_sweep

    def measured(*args, **kwargs):
        raise AssertionError("measured before the output was probed")

    for module, name in ((plan_measure, "measure_loop"), (plan_measure, "from_shapes"),
                         (bench_sweep, "measure_train"), (bench_sweep, "InferBench")):
        monkeypatch.setattr(module, name, measured)
    workload = ["--model", "vit-nano", *(["--mode", "infer"] if command == "bench" else [])]  # else measured
    code, _, err = run(capsys, command, *workload, "--output", "/proc/result.json")
    assert code == 2 and "--output: cannot write in /proc: /proc is a kernel file system" in one_line(err)
    assert not list(tmp_path.iterdir())


def test_names_from_the_inputs_are_text_in_report_md_and_report_csv(tmp_path, capsys):
    """Weak row: report.md carried raw HTML from model names; report.csv cells starting with = were
    formulas in a spreadsheet."""
    from tests.cost.test_report_reliability import result

    name = "=HYPERLINK(\"x\")<img src=x onerror=alert(1)>"
    code, err = report_line(capsys, result(tmp_path, model__name=name), "--out", tmp_path / "rep")
    assert code == 0, err
    md, csv_text = ((tmp_path / "rep" / f).read_text() for f in ("report.md", "report.csv"))
    assert "<img" not in md and "&lt;img src=x onerror=alert(1)&gt;" in md
    cells = next(__import__("csv").reader([line for line in csv_text.splitlines() if "HYPERLINK" in line]))
    assert "'" + name in cells and name not in cells


def test_verify_after_a_killed_prune_says_why_files_are_missing(tmp_path, capsys):
    """Weak row: after kill -9 during `cache prune`, verify listed the deleted files as `missing`
    with no hint (the manifest is rewritten only at the end). A killed prune leaves its mark."""
    import socket

    cache = make_cache(tmp_path / "c", {"xla/1": b"a", "xla/2": b"b"})
    (cache / "xla" / "1").unlink()  # deleted by the prune that was then killed
    mark = cache / f".prune.running-{socket.gethostname()}-999999999"  # a process id no process has
    mark.touch()
    code, out, _ = run(capsys, "cache", "verify", "--cache-dir", cache)
    assert code == 1 and "missing" in out and "a `cache prune` was killed before it finished" in out
    code, out, _ = run(capsys, "cache", "verify", "--cache-dir", cache, "--quarantine")
    assert not mark.exists()
    code, out, _ = run(capsys, "cache", "verify", "--cache-dir", cache)
    assert code == 0 and "killed" not in out


def test_a_prune_leaves_no_mark_when_it_finishes(tmp_path, capsys):
    cache = make_cache(tmp_path / "c", {"xla/1": b"a"})
    age(cache)
    code, out, _ = run(capsys, "cache", "prune", "--cache-dir", cache, "--older-than", "1d")
    assert code == 0 and "delete xla/1" in out
    assert not list(cache.glob(".prune.*"))


def test_pack_vouches_only_for_what_prune_would(tmp_path, capsys):
    """Weak row: `cache pack` recorded user files prune refuses to vouch for; unpacked into another
    cache they were recorded there, and a prune there deleted them."""
    cache = make_cache(tmp_path / "c", {"xla/1": b"graph"})
    (cache / "xla" / "notes").write_bytes(b"mine")
    code, out, err = run(capsys, "cache", "pack", "--cache-dir", cache, tmp_path / "p.tar.gz")
    assert code == 0, err
    with tarfile.open(tmp_path / "p.tar.gz") as tar:
        names = tar.getnames()
        packed = json.loads(tar.extractfile(store.MANIFEST).read())  # type: ignore[union-attr]
    assert "xla/1" in names and "xla/notes" not in names and "xla/notes" not in packed["files"]
    assert "left out 1" in out


def test_a_learning_rate_written_1e_3_in_yaml_is_a_number(tmp_path):
    """Weak row: YAML 1.1 (PyYAML) reads `lr: 1e-3` as the string '1e-3', which was refused."""
    from neuron_train.training.config_io import build_config, load_config_file

    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-3\n  weight_decay: 5E-2\nmodel:\n  name: vit-nano\n")
    cfg = build_config(load_config_file(str(path)), source=str(path))
    assert cfg.optim.lr == 1e-3 and cfg.optim.weight_decay == 0.05 and cfg.model.name == "vit-nano"
