"""Issue 21, parser attacks and environment mistakes: one short line and exit 2 (bad input) or 1,
never a traceback, never an error line of megabytes, never a run directory left behind.
In-process through `neuron_train.cli.main`; the crafted files are written here.
"""

from __future__ import annotations

import copy
import json

import pytest
from conftest import FAST, NANO, ROOT
from test_reliability_cache import make_archive, make_cache

from neuron_train import cli
from neuron_train.precompile import store
from neuron_train.training import rundir

DEEP = 20_000
ALIAS_BOMB = """\
train:
  batch_size:
    - &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
    - &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
    - &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
    - &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
    - &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
    - &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "PJRT_DEVICE", "NEURON_EXTRACT_GRAPHS_ONLY"):
        monkeypatch.delenv(var, raising=False)
    yield
    rundir.release_unused()


def run(capsys, *argv) -> tuple[int, str]:
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and len(err) < 800, err[:2000]
    return code, err


@pytest.mark.parametrize("name, text, expected", [
    ("deep.yaml", "train: " + "[" * DEEP + "]" * DEEP, "nested too deeply"),
    ("deep.toml", "a = " + "[" * DEEP + "]" * DEEP, "nested too deeply"),
    ("deeptable.toml", "a = " + "{b=" * DEEP + "1" + "}" * DEEP, "nested too deeply"),
    ("key.yaml", "train:\n  1: 2\n", "has a key that is not a name: 1"),
    ("section.yaml", "1: {}\n", "unknown section 1 "),
    ("bomb.yaml", ALIAS_BOMB, "train.batch_size: expected int, got [['lol'"),
])
def test_crafted_config_files_are_one_short_line(tmp_path, capsys, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    code, err = run(capsys, "train", "--config", path, "--output-dir", tmp_path / "run", *NANO, *FAST)
    assert code == 2 and expected in err
    assert not (tmp_path / "run").exists()


def test_a_manifest_nested_20000_levels_is_one_line(tmp_path, capsys):
    cache = make_cache(tmp_path / "c", {})
    (cache / store.MANIFEST).write_text('{"format": ' + "[" * DEEP + "]" * DEEP + "}")
    code, err = run(capsys, "cache", "list", "--cache-dir", cache)
    assert code == 1 and "nested too deeply" in err
    archive = make_archive(tmp_path / "a.tar.gz", {store.MANIFEST: ("[" * DEEP + "]" * DEEP).encode()})
    code, err = run(capsys, "cache", "unpack", "--cache-dir", tmp_path / "new", archive)
    assert code == 1 and "nested too deeply" in err


def test_a_result_file_nested_20000_levels_is_one_line(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text("[" * DEEP + "]" * DEEP)
    code, err = run(capsys, "report", path, "--out", tmp_path / "rep")
    assert code == 2 and "nested too deeply" in err and not (tmp_path / "rep").exists()


def test_an_error_line_is_capped_whatever_the_message():
    line = cli._capped(ValueError("x" * 100_000 + "\nsecond line"))
    assert len(line) < 700 and "\n" not in line and line.endswith("(99412 more characters)")


# ----- environment and path mistakes -------------------------------------------------------------
@pytest.mark.parametrize("device, expected", [("GPU", "this machine has no GPU device"),
                                              ("TPU", "this machine has no TPU device"),
                                              ("QUANTUM", "is not a device torch_xla knows")])
def test_a_pjrt_device_this_machine_lacks_is_one_line_before_anything_starts(tmp_path, capsys, monkeypatch,
                                                                              device, expected):
    monkeypatch.setenv("PJRT_DEVICE", device)
    code, err = run(capsys, "train", "--output-dir", tmp_path / "run", *NANO, *FAST, "--max-steps", "1")
    assert code == 2 and expected in err and "unset PJRT_DEVICE" in err
    assert not (tmp_path / "run").exists()


def test_world_size_without_a_launcher_is_one_line_naming_torchrun(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, err = run(capsys, "train", "--output-dir", tmp_path / "run", *NANO, *FAST, "--max-steps", "1")
    assert code == 2 and "WORLD_SIZE=4" in err and "torchrun --standalone --nproc_per_node=4" in err
    assert not (tmp_path / "run").exists()


def test_an_output_dir_that_is_a_dangling_symlink_is_one_line(tmp_path, capsys):
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "gone" / "elsewhere")
    code, err = run(capsys, "train", "--output-dir", link, *NANO, *FAST, "--max-steps", "1")
    assert code == 2 and "is a symbolic link to" in err and "which does not exist" in err
    assert link.is_symlink() and not (tmp_path / "gone").exists()


INFER = json.loads((ROOT / "tests" / "fixtures" / "report" / "cpu_infer_vit_digits.json").read_text())


@pytest.mark.parametrize("where", ["median", "values", "sweep"])
def test_a_finite_but_absurd_result_is_refused(tmp_path, capsys, monkeypatch, where):
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    r = copy.deepcopy(INFER)
    if where == "median":
        r["samples_per_sec"]["median"] = 1e308
    elif where == "values":
        r["samples_per_sec"]["values"] = [1e308] * len(r["samples_per_sec"]["values"])
    else:
        r["sweep"] = [{"batch_size_per_device": 32, "world_size": 1, "status": "ok", "reason": "",
                       "samples_per_sec": 1e308, "step_time_ms": 1.0, "compile_time_s": 1.0, "graph_count": 1}]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(r))
    code, err = run(capsys, "report", path, "--out", tmp_path / "rep")
    assert code == 2 and "not a measurement" in err and not (tmp_path / "rep").exists()
