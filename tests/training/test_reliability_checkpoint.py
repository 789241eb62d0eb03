"""Issue 21, checkpoints and run files: a really full disk is one line and loses nothing, a file
that loads but has the wrong structure or changed bytes is never used (the newest good checkpoint
is, with a note), and a save killed with SIGKILL never leaves a checkpoint that is not whole.
Real faults only: a tmpfs that fills up, bytes flipped in the file, kill -9 of a saving process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from neuron_train.common.errors import RunError, UsageError
from neuron_train.training import checkpoint as ckpt
from neuron_train.training import rundir
from neuron_train.training.checkpoint_format import checksum_file
from neuron_train.training.config_io import save_config
from neuron_train.training.metrics import MetricsWriter
from tests.conftest import ROOT, cpu_env
from tests.fullfs import fill, mounted_tmpfs
from tests.training.test_reliability_train import parse, run_cfg, save_checkpoint


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NEURON_EXTRACT_GRAPHS_ONLY"):
        monkeypatch.delenv(var, raising=False)
    yield
    rundir.release_unused()


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and len(text) < 600, text
    return text


# ----- a really full disk ------------------------------------------------------------------------
def test_a_checkpoint_save_on_a_really_full_disk_is_one_line_and_keeps_the_last_good_one(tmp_path):
    with mounted_tmpfs(tmp_path / "small", size="1m") as small:
        good = save_checkpoint(small, 1)
        with pytest.raises(RunError) as err:  # 2 MB of weights on a 1 MiB file system
            save_checkpoint(small, 2, weights={"w": torch.zeros(500_000)})
        msg = one_line(err.value)
        assert "no space left on" in msg and str(good) in msg and "--resume" in msg
        assert sorted(os.listdir(ckpt.checkpoint_dir(small))) == ["step-00000001.pt", "step-00000001.pt.sha256"]
        assert ckpt.load_resumable(good)["position"]["step"] == 1


def test_config_yaml_on_a_really_full_disk_is_one_line_and_stays_whole(tmp_path):
    with mounted_tmpfs(tmp_path / "small", size="1m") as small:
        path = small / "config.yaml"
        save_config(parse("--model", "vit-nano"), path)
        before = path.read_bytes()
        fill(small)
        with pytest.raises(RunError) as err:
            save_config(parse("--model", "vit-nano", "--lr", "0.5"), path)
        assert "no space left on the device of" in one_line(err.value)
        assert path.read_bytes() == before
        assert sorted(p.name for p in small.iterdir()) == ["config.yaml", "filler"]


# ----- files that load but have the wrong structure ----------------------------------------------
def crafted(base: dict, case: str) -> dict:
    state = {k: v for k, v in base.items()}
    if case == "only format":
        return {"format": 1}
    if case == "config a string":
        state["config"] = "vit-nano"
    elif case == "step a string":
        state["position"] = {**state["position"], "step": "6"}
    elif case == "no rng":
        del state["rng"]
    elif case == "empty optimizer":
        state["optimizer"] = {}
    elif case == "bogus position key":
        state["position"] = {**state["position"], "bogus": 1}
    elif case == "step -5":
        state["position"] = {**state["position"], "step": -5}
    return state


CASES = ["only format", "config a string", "step a string", "no rng", "empty optimizer", "bogus position key",
         "step -5"]
REASONS = ["no 'model', 'optimizer'", "'config' must be a dictionary", "'position.step' must be an integer",
           "no 'rng' entry", "holds no optimizer state", "must hold exactly step, epoch, batch",
           "'position.step' must be an integer >= 0, got -5"]


@pytest.mark.parametrize("case, reason", list(zip(CASES, REASONS, strict=True)))
def test_a_checkpoint_with_the_wrong_structure_is_one_line_and_skipped_for_the_previous_one(
        tmp_path, capsys, case, reason):
    out = tmp_path / "run"
    save_checkpoint(out, 4)
    base = ckpt.load(save_checkpoint(out, 6))
    newest = ckpt.checkpoint_dir(out) / "step-00000006.pt"
    torch.save(crafted({k: v for k, v in base.items() if k != "format"} | {"format": 1}, case), newest)
    checksum_file(newest).unlink()  # as if written by hand: only its structure can tell
    with pytest.raises(UsageError) as err:
        rundir.preflight(run_cfg(tmp_path / "other", "--max-steps", "8", "--resume", str(newest)))
    assert reason in one_line(err.value) and "cannot be resumed" in str(err.value)
    with pytest.raises(UsageError):
        ckpt.load_resumable(newest)
    cfg = run_cfg(out, "--max-steps", "8", "--resume")
    cfg, _ = rundir.preflight(cfg)  # the run directory's newest is that file: the previous good one is used
    assert cfg.checkpoint.resume == str(ckpt.checkpoint_dir(out) / "step-00000004.pt")
    err_text = capsys.readouterr().err
    assert "skipping a damaged checkpoint" in err_text and reason in err_text and "Traceback" not in err_text


def test_a_negative_step_is_never_saved(tmp_path):
    with pytest.raises(RunError, match="steps are >= 0"):
        save_checkpoint(tmp_path, -5)
    assert not ckpt.checkpoint_dir(tmp_path).exists() or not list(ckpt.checkpoint_dir(tmp_path).iterdir())


# ----- bytes changed inside an intact archive ----------------------------------------------------
def test_flipped_bytes_inside_an_intact_archive_are_found_before_use(tmp_path, capsys):
    out = tmp_path / "run"
    weights = {"w": torch.randn(20_000)}
    save_checkpoint(out, 4, weights=weights)
    newest = save_checkpoint(out, 6, weights=weights)
    data = bytearray(newest.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 2000] = bytes(b ^ 0xFF for b in data[middle:middle + 2000])
    newest.write_bytes(bytes(data))
    assert torch.load(newest, weights_only=True)["position"]["step"] == 6  # it still loads: only the sum tells
    with pytest.raises(UsageError) as err:
        ckpt.load_resumable(newest)
    assert "SHA-256 differs" in one_line(err.value)
    cfg = run_cfg(out, "--max-steps", "8", "--resume")
    cfg, _ = rundir.preflight(cfg)
    assert cfg.checkpoint.resume == str(ckpt.checkpoint_dir(out) / "step-00000004.pt")
    assert "skipping a damaged checkpoint" in capsys.readouterr().err


# ----- kill -9 during saves ----------------------------------------------------------------------
SAVER = """
import sys, torch, random
from neuron_train.training import checkpoint as ckpt
run, weights = sys.argv[1], {"w": torch.randn(3_000_000)}
for step in range(1, 10_000):
    ckpt.save(run, step, {"model": weights, "optimizer": {"state": {}, "param_groups": [{"params": [0]}]},
                          "position": {"step": step, "epoch": 0, "batch": step},
                          "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "xla": 0},
                          "global_batch": 32, "config": {"model": {"name": "vit-nano", "img_size": 32},
                                                         "train": {"batch_size": 32, "grad_accum": 1}}},
              keep_last=2)
"""


def mid_write(run, full: int) -> bool:
    """A save is under way: a temporary file exists, or a checkpoint file is not yet full size."""
    for p in ckpt.checkpoint_dir(run).iterdir():
        try:
            if ".tmp-" in p.name or (p.suffix == ".pt" and p.stat().st_size < full):
                return True
        except FileNotFoundError:  # renamed or pruned while we looked
            pass
    return False


@pytest.mark.slow
@pytest.mark.parametrize("attempt", [1, 2])
def test_a_save_killed_with_sigkill_leaves_only_whole_verified_checkpoints(tmp_path, attempt):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(run)], env=cpu_env(), cwd=ROOT)
    deadline = time.time() + 300
    while time.time() < deadline and len(ckpt.list_checkpoints(run)) < 2:
        time.sleep(0.02)
    full = ckpt.list_checkpoints(run)[0].stat().st_size
    while time.time() < deadline and not mid_write(run, full):
        pass  # no sleep: the write takes milliseconds
    os.kill(proc.pid, signal.SIGKILL)  # in the middle of writing a checkpoint
    proc.wait(timeout=60)
    found = ckpt.list_checkpoints(run)
    assert found
    for path in found:  # every checkpoint under its final name is whole and matches its checksum
        assert checksum_file(path).is_file()
        assert ckpt.load_resumable(path)["position"]["step"] == int(path.stem.split("-")[1])
    ckpt.remove_stale_temps(run)
    left = sorted(p.name for p in ckpt.checkpoint_dir(run).iterdir())
    assert left == sorted([p.name for p in found] + [p.name + ".sha256" for p in found])


# ----- a checkpoint without its checksum ---------------------------------------------------------
def test_a_checkpoint_without_its_checksum_is_used_with_one_note_and_gets_none(tmp_path, capsys):
    """Saved by an older version, or copied alone: --resume and --pretrained use it, unverified,
    saying so once on stderr; no .sha256 is written for a file we did not see written."""
    out = tmp_path / "run"
    save_checkpoint(out, 2)
    path = ckpt.checkpoint_dir(out) / "step-00000002.pt"
    checksum_file(path).unlink()
    cfg = run_cfg(out, "--max-steps", "8", "--resume")
    rundir.preflight(cfg)  # reads the file's metadata (and the run then loads it whole)
    assert ckpt.load_resumable(path)["position"]["step"] == 2
    notes = [line for line in capsys.readouterr().err.splitlines() if "checksum" in line]
    assert notes == [f"note: {path} has no step-00000002.pt.sha256 beside it (saved by an older neuron-train, "
                     "or copied without it): loaded without a checksum check; copy the .sha256 file with it "
                     "to have it verified"]
    weights = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, weights)  # a state dict from elsewhere: --pretrained
    ckpt.read(weights, "cannot read weights from")
    assert f"note: {weights} has no weights.pt.sha256 beside it" in capsys.readouterr().err
    assert not checksum_file(path).exists() and not checksum_file(weights).exists()
    save_checkpoint(out, 4)  # a file we write and verify is not noted
    ckpt.load_resumable(ckpt.checkpoint_dir(out) / "step-00000004.pt")
    assert "checksum" not in capsys.readouterr().err


# ----- metrics.jsonl on --resume -----------------------------------------------------------------
def test_resume_repairs_a_metrics_file_cut_mid_line_and_drops_records_after_the_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"kind": "train", "step": s, "loss": 1.0 / (s + 1)} for s in range(8)]
    records.insert(5, {"kind": "eval", "step": 4, "eval_accuracy": 0.5})
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run / "metrics.jsonl").write_text(text + '{"kind": "train", "step": 8, "lo')  # killed mid-write
    writer = MetricsWriter(run, tensorboard=False, resume_step=4)  # resumed from step-00000004.pt
    writer.write(4, {"loss": 0.2})
    writer.close()
    got = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # every line parses
    assert [(r["kind"], r["step"]) for r in got] == [("train", 0), ("train", 1), ("train", 2), ("train", 3),
                                                     ("eval", 4), ("train", 4)]
    assert "dropped 5 record(s)" in capsys.readouterr().err


def test_a_metrics_file_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside.jsonl"
    run.mkdir()
    outside.write_text("precious\n")
    (run / "metrics.jsonl").symlink_to(outside)
    for resume_step in (None, 3):
        with pytest.raises(RunError, match="is a symbolic link, not the run's metrics.jsonl"):
            MetricsWriter(run, tensorboard=False, resume_step=resume_step)
    assert outside.read_text() == "precious\n"
