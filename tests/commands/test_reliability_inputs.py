"""Issue 21, parser attacks and environment mistakes: one short line and exit 2 (bad input) or 1,
never a traceback, never an error line of megabytes, never a run directory left behind.
In-process through `neuron_train.cli.main`; the crafted files are written here.
"""

from __future__ import annotations

import copy
import json

import pytest

from neuron_train import cli
from neuron_train.common.neuron_env import neuron_device_present
from neuron_train.precompile import store
from neuron_train.training import rundir
from tests.conftest import FAST, NANO, ROOT
from tests.precompile.test_reliability_cache import make_archive, make_cache

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
# a bomb like the round-4 review's (511 bytes here): nine levels of nine aliases, 9**10 strings once expanded
BIG_ALIAS_BOMB = "optim:\n  lr:\n" + "    - &l0 [" + ",".join(['"lol"'] * 9) + "]\n" + "".join(
    f"    - &l{n} [" + ",".join([f"*l{n - 1}"] * 9) + "]\n" for n in range(1, 10))



@pytest.fixture(autouse=True)
def _clean_env(in_process_cli):
    """No launcher variables in the in-process CLI runs (conftest's in_process_cli)."""


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
    ("bomb.yaml", ALIAS_BOMB, "line 4: a YAML alias (*name) is not accepted"),
    ("bigbomb.yaml", BIG_ALIAS_BOMB, "a YAML alias (*name) is not accepted"),
    ("digits.yaml", "optim:\n  lr: " + "9" * 400 + "\n", "optim.lr: an integer of 400 digits"),
    ("digits.toml", "[optim]\nlr = " + "9" * 400 + "\n", "optim.lr: an integer of 400 digits"),
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
                                              ("QUANTUM", "is not a device torch_xla knows"),
                                              ("cpu", "torch_xla reads device names in capitals: set PJRT_DEVICE=CPU"),
                                              pytest.param("NEURON", "PJRT_DEVICE=NEURON, but ",
                                                           marks=pytest.mark.skipif(
                                                               neuron_device_present(),
                                                               reason="this machine has a Neuron device"))])
def test_a_pjrt_device_this_machine_lacks_is_one_line_before_anything_starts(tmp_path, capsys, monkeypatch,
                                                                              device, expected):
    monkeypatch.setenv("PJRT_DEVICE", device)
    code, err = run(capsys, "train", "--output-dir", tmp_path / "run", *NANO, *FAST, "--max-steps", "1")
    assert code == 2 and expected in err and "unset PJRT_DEVICE" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["XLA_USE_BF16", "XLA_DOWNCAST_BF16"])
def test_a_bf16_variable_torch_xla_would_read_as_off_is_one_line(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setenv(name, "banana")
    code, err = run(capsys, "train", "--output-dir", tmp_path / "run", *NANO, *FAST, "--max-steps", "1")
    assert code == 2 and f"{name}='banana' is neither 1 nor 0" in err
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
        r["samples_per_sec"]["median"] = 1e15
    elif where == "values":
        r["samples_per_sec"]["values"] = [1e15] * len(r["samples_per_sec"]["values"])
    else:
        r["sweep"] = [{"batch_size_per_device": 32, "world_size": 1, "status": "ok", "reason": "",
                       "samples_per_sec": 1e15, "step_time_ms": 1.0, "compile_time_s": 1.0, "graph_count": 1}]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(r))
    code, err = run(capsys, "report", path, "--out", tmp_path / "rep")
    assert code == 2 and "not a measurement" in err and not (tmp_path / "rep").exists()


# ----- weak cases of issue 21 --------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [("--lr", "inf"), ("--lr", "nan"), ("--min-lr", "nan"), ("--grad-clip", "inf")])
def test_a_float_that_is_not_finite_is_refused_up_front(tmp_path, capsys, flag, value):
    code, err = run(capsys, "train", "--output-dir", tmp_path / "run", *NANO, *FAST, flag, value)
    assert code == 2 and f"{flag} must be a finite number, got {value}" in err
    assert not (tmp_path / "run").exists()


def test_resuming_with_another_seed_is_refused_naming_the_seed(tmp_path):
    from tests.training.test_reliability_train import run_cfg, save_checkpoint

    save_checkpoint(tmp_path / "run", 4, "--seed", "7")
    with pytest.raises(cli.UsageError,
                       match="was trained with --seed 7, this run has --seed 0: .*resume with --seed 7"):
        rundir.preflight(run_cfg(tmp_path / "run", "--max-steps", "8", "--resume"))
    rundir.preflight(run_cfg(tmp_path / "run", "--max-steps", "8", "--resume", "--seed", "7"))


def test_a_negative_size_says_how_to_write_it(tmp_path, capsys):
    cache = make_cache(tmp_path / "c", {})
    code, err = run(capsys, "cache", "prune", "--cache-dir", cache, "--max-size", "-1G")
    assert code == 2 and "written --max-size=VALUE" in err
    code, err = run(capsys, "cache", "prune", "--cache-dir", cache, "--max-size=-1G")
    assert code == 2 and "expected a size >= 0" in err


def test_a_result_file_given_twice_and_duplicate_prices_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(INFER))
    (tmp_path / "sub").mkdir()
    for twice in ([path, path], [path, tmp_path / "sub" / ".." / "r.json"]):
        code, err = run(capsys, "report", *twice, "--out", tmp_path / "rep")
        assert code == 2 and "is given twice" in err and not (tmp_path / "rep").exists()
    prices = tmp_path / "prices.yaml"
    row = "{instance_type: %s, usd_per_hour: %s, region: us-east-1, date: 2026-11-01, source: s}"
    prices.write_text(f"prices:\n- {row % ('trn1.2xlarge', 1.3)}\n- {row % ('TRN1.2xlarge', 0.5)}\n")
    code, err = run(capsys, "report", path, "--prices", prices, "--out", tmp_path / "rep")
    assert code == 2 and "price entry 2: TRN1.2xlarge is priced twice" in err


def wait_for_metrics(out, proc, timeout=600):
    import time
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2:
            return
        time.sleep(0.1)
    raise AssertionError(f"no training step logged: {proc.stderr.read()[-2000:] if proc.poll() is not None else ''}")


@pytest.mark.slow
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_saves_at_the_next_step_and_a_second_one_aborts_without_a_traceback(tmp_path, presses):
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import RUN_PY, cpu_env

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(RUN_PY), "--output-dir", str(out), *FAST, *NANO, "--max-steps",
                             "100000", "--log-every", "1", "--eval-every", "100000"], env=cpu_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_metrics(out, proc)
    for _ in range(presses):
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)  # two handler calls, not one coalesced signal
    _, err = proc.communicate(timeout=600)
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    if presses == 1:
        assert proc.returncode == 1 and "stopped by SIGINT at step" in err and "continue with --resume" in err
        assert list((out / "checkpoints").glob("step-*.pt"))
    else:
        assert proc.returncode == 130 and "interrupted again" in err, err[-3000:]
