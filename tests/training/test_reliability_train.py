"""Training runs under bad input and faults (issue 12): one clear line, nothing lost or half-written.

In-process tests drive the checks that run before torch_xla starts (training/rundir.py), checkpoint
saving and loading, and the data checks, on fixtures made here. The `slow` tests run the real
command end to end (vit-nano, the fewest steps), sharing one trained run between several cases.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import random
import shutil
import subprocess
import sys
import time

import pytest
import torch

from neuron_train.common.errors import RunError, UsageError
from neuron_train.training import checkpoint as ckpt
from neuron_train.training import rundir
from neuron_train.training.config import RunConfig
from neuron_train.training.config_io import add_config_arguments, config_from_args, load_config_file
from neuron_train.training.data import build_datasets, check_images
from neuron_train.training.models import build_model, create_model, load_weights, read_state_dict
from tests.conftest import FAST, NANO, ROOT, RUN_PY, cpu_env, run_train, summary_of


def parse(*argv: str) -> RunConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def run_cfg(out, *argv: str) -> RunConfig:
    return parse("--output-dir", str(out), *NANO, *argv)


def save_checkpoint(run_dir, step: int, *argv: str, world: int = 1, weights=None, zero1_ranks=None):
    """A checkpoint as the loop writes it (its config says which model and batch it is from)."""
    cfg = parse(*NANO, *argv)
    state = {"model": {"w": torch.zeros(2)} if weights is None else weights,
             "optimizer": ckpt.sharded_marker(zero1_ranks) if zero1_ranks else {"state": {}, "param_groups": [
                 {"params": [0], "lr": 1e-3}]},
             "position": {"step": step, "epoch": 0, "batch": step},
             "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "xla": 0},
             "global_batch": cfg.train.batch_size * cfg.train.grad_accum * world, "config": cfg.to_dict()}
    return ckpt.save(run_dir, step, state, keep_last=5)


def snapshot(d) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


class OneRank:
    """The part of training.device.Backend that open_run_dir uses, for a single process."""

    is_main, world_size = True, 1

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj):
        return obj


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NEURON_EXTRACT_GRAPHS_ONLY"):
        monkeypatch.delenv(var, raising=False)
    yield
    rundir.release_unused()  # the locks this test took, as the command does at its end


# ----- a finished run ---------------------------------------------------------------------------
def test_resume_of_a_finished_run_changes_nothing_unless_the_target_grew(tmp_path):
    out = tmp_path / "run"
    save_checkpoint(out, 2)
    (out / "summary.json").write_text('{"final_loss": 0.25}\n')
    before = snapshot(out)
    _, finished = rundir.preflight(run_cfg(out, "--max-steps", "2", "--resume"))
    assert "is finished: its checkpoint is at step 2" in finished and "larger --max-steps" in finished
    rundir.release_unused()
    assert snapshot(out) == before and not (out / ".lock").exists()
    grown, finished = rundir.preflight(run_cfg(out, "--max-steps", "3", "--resume"))
    assert finished is None
    assert grown.checkpoint.resume == str(ckpt.checkpoint_dir(out) / "step-00000002.pt")


# ----- the run-directory lock -------------------------------------------------------------------
def test_a_second_run_into_a_locked_directory_is_refused_in_one_line(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = os.open(out / ".lock", os.O_RDWR | os.O_CREAT)  # another open file: flock conflicts
    fcntl.flock(holder, fcntl.LOCK_EX)
    os.write(holder, b"pid 4242 on elsewhere\n")
    try:
        with pytest.raises(RunError, match=r"is in use by another run \(pid 4242 on elsewhere\)") as err:
            rundir.preflight(run_cfg(out, "--max-steps", "2"))
        assert "\n" not in str(err.value)
    finally:
        os.close(holder)
    rundir.preflight(run_cfg(out, "--max-steps", "2"))  # free again: this process holds it now
    with open(out / ".lock") as fh, pytest.raises(BlockingIOError):
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    rundir.release_unused()  # nothing was written: the directory is as it was
    assert sorted(os.listdir(out)) == [".lock"]


def test_a_refused_run_leaves_no_directory_behind(tmp_path):
    out = tmp_path / "new" / "run"
    with pytest.raises(UsageError):
        rundir.preflight(run_cfg(out, "--batch-size", "4096"))
    created = run_cfg(out, "--max-steps", "1")
    rundir.preflight(created)
    assert (out / ".lock").exists()
    rundir.release_unused()  # e.g. torch_xla failed to start: nothing written
    assert not out.exists()


# ----- checkpoint saves that fail --------------------------------------------------------------
def test_a_full_disk_during_a_save_says_so_names_the_last_good_checkpoint_and_leaves_no_temp(
        tmp_path, monkeypatch):
    good = save_checkpoint(tmp_path, 1)
    real_save = torch.save

    def disk_fills_up(obj, fh):
        real_save(obj, fh)  # some bytes reach the temporary file first
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", disk_fills_up)
    with pytest.raises(RunError) as err:
        save_checkpoint(tmp_path, 2)
    msg = str(err.value)
    assert f"no space left on {ckpt.checkpoint_dir(tmp_path)}" in msg and str(good) in msg
    assert "step-00000002.pt was not saved" in msg and "\n" not in msg
    assert sorted(os.listdir(ckpt.checkpoint_dir(tmp_path))) == ["step-00000001.pt", "step-00000001.pt.sha256"]


def test_a_save_interrupted_in_process_removes_its_temp_file(tmp_path, monkeypatch):
    def interrupted(obj, fh):
        fh.write(b"PK\x03\x04 half")
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 3)
    assert os.listdir(ckpt.checkpoint_dir(tmp_path)) == []


def test_temp_files_of_a_process_killed_mid_save_are_removed_at_the_next_start(tmp_path, capsys):
    out = tmp_path / "run"
    save_checkpoint(out, 4)
    d = ckpt.checkpoint_dir(out)
    for name in (".step-00000008.pt.tmp-otherhost-99999", ".step-00000008.optim-rank1.pt.tmp-99998"):
        (d / name).write_bytes(b"PK\x03\x04 cut short")
    (out / ".summary.json.k2j4.tmp").write_text("{")
    cfg, _ = rundir.preflight(run_cfg(out, "--max-steps", "8", "--resume"))
    rundir.open_run_dir(cfg, OneRank(), extracting=False)
    assert sorted(os.listdir(d)) == ["step-00000004.pt", "step-00000004.pt.sha256"]
    assert not (out / ".summary.json.k2j4.tmp").exists()
    assert "removed 3 temporary file(s) of a save that never finished" in capsys.readouterr().err


# ----- damaged checkpoints ---------------------------------------------------------------------
def test_a_truncated_newest_checkpoint_falls_back_to_the_newest_good_one(tmp_path, capsys):
    out = tmp_path / "run"
    for step in (2, 4, 6):
        save_checkpoint(out, step)
    newest = ckpt.checkpoint_dir(out) / "step-00000006.pt"
    newest.write_bytes(newest.read_bytes()[:300])
    cfg, _ = rundir.preflight(run_cfg(out, "--max-steps", "8", "--resume"))
    assert cfg.checkpoint.resume == str(ckpt.checkpoint_dir(out) / "step-00000004.pt")
    err = capsys.readouterr().err
    assert "skipping a damaged checkpoint" in err and "step-00000006.pt: truncated (300 bytes)" in err
    assert "resuming from" in err and "step-00000004.pt (step 4), the newest good checkpoint" in err
    assert "Errno" not in err
    for step in (2, 4):  # none left: one line, not a traceback
        (ckpt.checkpoint_dir(out) / f"step-{step:08d}.pt").write_bytes(b"")
    with pytest.raises(UsageError, match=r"no checkpoint in .* can be loaded \(3 tried; the newest: .*truncated"):
        rundir.preflight(run_cfg(out, "--max-steps", "8", "--resume"))


@pytest.mark.parametrize("content, reason", [
    (os.urandom(5000), "not a checkpoint or state dict"),
    (b"", "the file is empty"),
    (b"hello, world\n", "not a checkpoint or state dict"),
    ("malicious", "holds Python objects, not only tensors"),
    ("truncated", "truncated"),
])
def test_files_we_did_not_write_are_one_line_and_never_advise_weights_only_false(tmp_path, content, reason):
    path = tmp_path / "file.pt"
    if content == "malicious":
        torch.save({"weights": os.system}, path)  # pickled as a call to os.system: never loaded
    elif content == "truncated":
        torch.save({"w": torch.ones(100)}, path)
        path.write_bytes(path.read_bytes()[:-200])
    else:
        path.write_bytes(content)
    for load in (ckpt.load, read_state_dict):
        with pytest.raises(UsageError) as err:
            load(path)
        msg = str(err.value)
        assert reason in msg and "\n" not in msg and "weights_only" not in msg, msg


def test_a_state_dict_is_not_resumed_but_pointed_to_pretrained(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2)}, path)
    with pytest.raises(UsageError, match="not a neuron_train checkpoint .* pass it as --pretrained"):
        rundir.preflight(run_cfg(tmp_path / "run", "--max-steps", "2", "--resume", str(path)))


# ----- checkpoints from another model -----------------------------------------------------------
def test_a_checkpoint_of_another_model_is_one_line_naming_that_model(tmp_path, capsys):
    digits = create_model("vit-digits", num_classes=10, img_size=32)
    path = save_checkpoint(tmp_path / "old", 5, "--model", "vit-digits", weights=digits.state_dict())
    with pytest.raises(UsageError, match="is a checkpoint of model vit-digits at --img-size 32, this run "
                                         "builds vit-nano at 32: resume with --model vit-digits"):
        rundir.preflight(run_cfg(tmp_path / "new", "--max-steps", "9", "--resume", str(path)))
    nano = create_model("vit-nano", num_classes=10, img_size=32)
    with pytest.raises(UsageError) as err:
        ckpt.load_model_state(nano, ckpt.load(path), path)
    msg = str(err.value)
    assert "does not fit this model" in msg and "from model vit-digits" in msg and "\n" not in msg
    assert "unknown (blocks.1." in msg and "of another shape" in msg
    build_model("vit-nano", num_classes=10, img_size=32, pretrained=str(path))  # --pretrained: partial
    note = capsys.readouterr().out
    assert f"note: {path} (model vit-digits (--img-size 32)): " in note and "left at random init" in note
    foreign = tmp_path / "foreign.pt"
    torch.save({"other.weight": torch.zeros(3, 3)}, foreign)
    with pytest.raises(UsageError, match=r"no weight matches this model's parameters \(.*1 unknown "
                                         r"\(other.weight\)\); the file is from a file without neuron_train"):
        load_weights(nano, foreign)


def test_missing_and_unknown_keys_are_counted_in_one_line(tmp_path):
    nano = create_model("vit-nano", num_classes=10, img_size=32)
    weights = dict(nano.state_dict())
    del weights["head.weight"], weights["head.bias"]
    weights["extra.bias"] = torch.zeros(3)
    path = save_checkpoint(tmp_path, 3, weights=weights)
    with pytest.raises(UsageError, match=r"2 missing \(head.weight, head.bias\), 1 unknown \(extra.bias\) "
                                         r"weights; it is from model vit-nano"):
        ckpt.load_model_state(nano, ckpt.load(path), path)


# ----- world size on resume ---------------------------------------------------------------------
def test_resume_on_another_number_of_ranks_is_one_run_error_naming_the_ranks(tmp_path, monkeypatch):
    out = tmp_path / "run"
    save_checkpoint(out, 4)  # 1 rank x batch 32
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # as torchrun sets it
    with pytest.raises(RunError) as err:
        rundir.preflight(run_cfg(out, "--max-steps", "8", "--resume"))
    msg = str(err.value)
    assert "global batch of 32 (1 rank(s) x batch 32 x accum 1), this run has 64" in msg
    assert "torchrun --standalone --nproc_per_node=1, or keep 2 ranks with --batch-size 16" in msg
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(UsageError, match="resume with --batch-size 32 --grad-accum 1"):
        rundir.preflight(run_cfg(out, "--max-steps", "8", "--batch-size", "16", "--resume"))
    zero1 = tmp_path / "zero1"
    save_checkpoint(zero1, 4, "--batch-size", "16", "--zero1", world=2, zero1_ranks=2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(UsageError, match="shards of 2 ranks, this run has 4"):
        rundir.preflight(run_cfg(zero1, "--max-steps", "8", "--batch-size", "8", "--zero1", "--resume"))


# ----- a run stopped before its first checkpoint ------------------------------------------------
def test_a_run_killed_before_its_first_checkpoint_is_restarted_by_resume(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("train: {}\n")
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 0}\n')
    with pytest.raises(UsageError, match="stopped before its first checkpoint .* pass --resume to start it again"):
        rundir.preflight(run_cfg(out, "--max-steps", "2"))
    cfg, _ = rundir.preflight(run_cfg(out, "--max-steps", "2", "--resume"))
    assert "starting it again from step 0; its files move to attempt-1/" in capsys.readouterr().err
    assert cfg.checkpoint.resume == "latest"
    _, cfg = rundir.open_run_dir(cfg, OneRank(), extracting=False)
    assert cfg.checkpoint.resume is None  # the loop trains from step 0
    assert sorted(os.listdir(out)) == [".lock", "attempt-1"]
    assert (out / "attempt-1" / "metrics.jsonl").read_text() == '{"kind": "train", "step": 0}\n'


class _LoopReached(Exception):
    pass


def test_the_loop_is_handed_the_config_preflight_and_precision_resolved(tmp_path, monkeypatch):
    """`train` in process up to the loop (a stand-in for training.loop that records what it is given
    and stops): `--resume` becomes the checkpoint preflight chose, and XLA_USE_BF16=1 in the shell the
    precision. The config is frozen, so each is a new config that the command must pass on."""
    import types

    from neuron_train import graphs
    from neuron_train.commands import train as train_command
    from neuron_train.training import device

    out = tmp_path / "run"
    save_checkpoint(out, 2)
    seen: list[RunConfig] = []

    def loop_train(cfg: RunConfig, backend: object) -> dict:
        seen.append(cfg)
        raise _LoopReached

    monkeypatch.setitem(sys.modules, "neuron_train.training.loop", types.SimpleNamespace(train=loop_train))
    monkeypatch.setattr(device, "init_backend", lambda: types.SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(graphs, "prepare_process", lambda check: None)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("XLA_USE_BF16", "1")
    parser = argparse.ArgumentParser()
    train_command.configure_parser(parser)
    with pytest.raises(_LoopReached):
        train_command.main(parser.parse_args(["--output-dir", str(out), *NANO, "--max-steps", "4", "--resume"]))
    assert seen[0].checkpoint.resume == str(ckpt.checkpoint_dir(out) / "step-00000002.pt")
    assert seen[0].train.precision == "xla-use-bf16"


def test_resume_with_nothing_to_resume_still_says_no_checkpoint(tmp_path):
    with pytest.raises(UsageError, match="no checkpoint in"):
        rundir.preflight(run_cfg(tmp_path / "empty", "--max-steps", "2", "--resume"))
    assert not (tmp_path / "empty").exists()


# ----- folder datasets --------------------------------------------------------------------------
def image_folder(root, classes, n=4, split_classes=None):
    from PIL import Image

    for split, names in (("train", classes), ("val", split_classes or classes)):
        for c, cls in enumerate(names):
            d = root / split / cls
            d.mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (20, 16), color=(i * 40, c * 60, 90)).save(d / f"{i}.jpg")
    return root


def test_a_val_class_that_train_lacks_is_refused_naming_it(tmp_path):
    root = image_folder(tmp_path / "imgs", ["cat", "dog"], split_classes=["cat", "emu"])
    cfg = run_cfg(tmp_path / "run", "--dataset", "folder", "--data-dir", str(root), "--batch-size", "2")
    with pytest.raises(UsageError, match=r"val has 1 class\(es\) that .*train lacks \(emu\)"):
        rundir.preflight(cfg)
    assert not (tmp_path / "run").exists()


def test_val_labels_follow_train_class_names_when_val_lacks_a_class(tmp_path):
    root = image_folder(tmp_path / "imgs", ["cat", "dog", "eel"], split_classes=["cat", "eel"])
    cfg = parse("--dataset", "folder", "--data-dir", str(root))
    data = build_datasets(cfg.data, 32, 0, 0)
    eel = data.train.class_to_idx["eel"]
    assert eel == 2 and {y for p, y in data.val.samples if "/eel/" in p} == {eel}


@pytest.mark.parametrize("damage, reason", [
    (lambda f: f.write_bytes(b""), "empty file (0 bytes)"),
    # fixed bytes: PIL decoded about 1 in 4,000 random 600-byte files (a flaky case)
    (lambda f: f.write_bytes(b"not an image, a line of text\n" * 20), "not an image format PIL can read"),
    (lambda f: f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2]), "truncated"),
])
def test_a_damaged_image_is_refused_before_any_run_directory_exists(tmp_path, damage, reason):
    root = image_folder(tmp_path / "imgs", ["cat", "dog"], n=8)
    big = root / "train" / "dog" / "7.jpg"
    from PIL import Image

    Image.effect_noise((64, 64), 60).convert("RGB").save(big)  # enough bytes that half of it is cut
    damage(big)
    args = ["--dataset", "folder", "--data-dir", str(root), "--batch-size", "2"]
    with pytest.raises(UsageError) as err:
        rundir.preflight(run_cfg(tmp_path / "run", *args))
    msg = str(err.value)
    assert "1 of 32 images" in msg and "train/dog/7.jpg" in msg and reason in msg and "\n" not in msg
    assert not (tmp_path / "run").exists()  # nothing blocks the next run or --resume
    rundir.preflight(run_cfg(tmp_path / "run", *args, "--no-check-images"))  # the user's call


def test_intact_images_with_bytes_after_the_end_marker_pass(tmp_path):
    root = image_folder(tmp_path / "imgs", ["cat"], n=2)
    f = root / "train" / "cat" / "0.jpg"
    f.write_bytes(f.read_bytes() + b"\0" * 4096)  # camera padding: the marker is not at the end
    cfg = parse("--dataset", "folder", "--data-dir", str(root))
    check_images(build_datasets(cfg.data, 32, 0, 0), root)


# ----- output directory, config file ------------------------------------------------------------
def test_an_output_dir_that_is_a_file_or_under_one_is_one_line(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        rundir.preflight(run_cfg(f, "--max-steps", "1"))
    with pytest.raises(UsageError, match="afile is a file, not a directory"):
        rundir.preflight(run_cfg(f / "sub", "--max-steps", "1"))


def make_read_only(d) -> list[str]:
    """A directory nobody may write into: mode 555, or for root (who ignores modes) the immutable
    attribute; returns the command that undoes it, or skips where neither works."""
    d.chmod(0o555)
    if os.geteuid() != 0:
        return ["chmod", "755", str(d)]
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        d.chmod(0o755)
        pytest.skip("running as root on a file system without chattr +i: no read-only directory")
    return ["chattr", "-i", str(d)]


def test_a_read_only_output_dir_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    undo = make_read_only(ro)
    try:
        for out in (ro, ro / "run"):
            with pytest.raises(UsageError, match="is not writable .*: choose another --output-dir"):
                rundir.preflight(run_cfg(out, "--max-steps", "1"))
    finally:
        subprocess.run(undo, check=True)
        ro.chmod(0o755)


def test_a_non_utf8_config_file_is_one_line(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_bytes(b"train:\n  epochs: 1  # caf\xe9\n")
    with pytest.raises(UsageError, match=r"run.yaml: not UTF-8 text \(byte 0xe9 at offset 25\): save it as UTF-8"):
        load_config_file(str(f))


# ----- refusals before torch_xla starts ---------------------------------------------------------
@pytest.mark.slow
def test_errors_found_before_start_up_come_before_torch_xla_and_leave_no_directory(tmp_path):
    empty = tmp_path / "empty-data"
    (empty / "train").mkdir(parents=True)
    code = ("import sys; from neuron_train.cli import main; rc = main(sys.argv[1:]); "
            "print('torch_xla imported' if 'torch_xla' in sys.modules else 'torch_xla not imported'); "
            "sys.exit(rc)")
    for args, message in ((["--model", "nosuch"], "unknown model 'nosuch'"),
                          (["--batch-size", "4096"], "use --batch-size 1497 or less"),
                          (["--dataset", "folder", "--data-dir", str(empty)], "Couldn't find any class folder")):
        out = tmp_path / "run"
        proc = subprocess.run([sys.executable, "-c", code, "train", "--output-dir", str(out), *FAST, *NANO, *args],
                              env=cpu_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
        assert "torch_xla not imported" in proc.stdout and "Traceback" not in proc.stderr
        assert not out.exists()


# ----- end to end -------------------------------------------------------------------------------
def _wait_for_lock(out, proc, timeout=300):
    end = time.time() + timeout
    while time.time() < end:
        if (out / ".lock").exists() and (out / ".lock").read_text().startswith("pid"):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before locking: {proc.stderr.read()[-2000:]}")
        time.sleep(0.1)
    raise AssertionError("no lock")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run killed before its first checkpoint, restarted by --resume; a second run started into
    the same directory while the first runs. Returns the finished run's directory and what was seen."""
    out = tmp_path_factory.mktemp("e2e") / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 0, "loss": 9.0}\n')
    (out / "config.yaml").write_text("train: {}\n")
    args = [*FAST, *NANO, "--max-steps", "2", "--checkpoint-every", "1", "--eval-every", "100"]
    first = subprocess.Popen([sys.executable, str(RUN_PY), "--output-dir", str(out), *args, "--resume"],
                             env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_lock(out, first)
    second = subprocess.run([sys.executable, str(RUN_PY), "--output-dir", str(out), *args],
                            env=cpu_env(), capture_output=True, text=True, timeout=300)
    first_out, first_err = first.communicate(timeout=900)
    return out, first.returncode, first_err, second


@pytest.mark.slow
def test_restarted_run_trains_while_a_second_run_is_refused_by_the_lock(finished_run):
    out, code, err, second = finished_run
    assert code == 0, err[-3000:]
    assert "starting it again from step 0; its files move to attempt-1/" in err
    assert second.returncode == 1 and "is in use by another run (pid " in second.stderr, second.stderr
    assert len(second.stderr.strip().splitlines()) == 1 and "Traceback" not in second.stderr
    s = summary_of(out)
    assert s["steps"] == 2 and s["resumed_from"] is None
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == [0, 1]  # not mixed with attempt 1
    assert json.loads((out / "attempt-1" / "metrics.jsonl").read_text())["loss"] == 9.0
    assert not (out / ".lock").exists() and not list(out.rglob("*.tmp*"))


@pytest.mark.slow
def test_finished_run_resumed_is_left_byte_for_byte(finished_run):
    out = finished_run[0]
    before = snapshot(out)
    proc = run_train(out, *NANO, "--max-steps", "2", "--eval-every", "100", "--resume")
    assert proc.returncode == 0 and "is finished: its checkpoint is at step 2" in proc.stdout, proc.stderr
    assert snapshot(out) == before


@pytest.mark.slow
def test_truncated_newest_checkpoint_resumes_from_the_previous_one_when_the_target_grew(finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run[0], out)
    newest = ckpt.checkpoint_dir(out) / "step-00000002.pt"
    newest.write_bytes(newest.read_bytes()[:2000])
    (ckpt.checkpoint_dir(out) / ".step-00000003.pt.tmp-99999").write_bytes(b"PK\x03\x04")  # killed mid-save
    proc = run_train(out, *NANO, "--max-steps", "3", "--eval-every", "100", "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step-00000002.pt: truncated (2000 bytes)" in proc.stderr
    assert "the newest good checkpoint" in proc.stderr and "removed 1 temporary file(s)" in proc.stderr
    s = summary_of(out)
    assert s["steps"] == 3 and s["resumed_from"].endswith("step-00000001.pt")
    assert not list(out.rglob("*.tmp*"))


@pytest.mark.slow
def test_torchrun_world_size_mismatch_ends_with_our_line(finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run[0], out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(RUN_PY),
           "--output-dir", str(out), *FAST, *NANO, "--max-steps", "4", "--resume"]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    line = "neuron-train train: "
    ours = [x for x in proc.stderr.splitlines() if x.startswith(line)]
    assert proc.returncode != 0 and len(ours) == 1, proc.stderr[-3000:]  # local rank 0 says it once
    assert "global batch of 32" in ours[0] and "--nproc_per_node=1" in ours[0]
    report = proc.stderr[proc.stderr.index("Root Cause"):]
    assert f"traceback : {ours[0]}" in report  # torchrun's own report carries the line


@pytest.mark.slow
def test_a_quiet_torchrun_rank_waits_to_be_stopped_instead_of_exiting_before_rank_0_prints(tmp_path):
    """Rank 1 of a run refused before start-up hands its line to torchrun's error file, says nothing, and
    stays until torchrun stops it (torchrun stops every rank at the first exit: a rank 1 exiting first
    could have rank 0 stopped before it printed). The error file is the event this test waits on."""
    import signal

    error_file = tmp_path / "error.json"
    env = cpu_env(LOCAL_RANK="1", RANK="1", WORLD_SIZE="2", TORCHELASTIC_RUN_ID="test",
                  TORCHELASTIC_ERROR_FILE=str(error_file))
    proc = subprocess.Popen([sys.executable, str(RUN_PY), "--output-dir", str(tmp_path / "run"), *FAST,
                             "--lr", "-1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not error_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert error_file.exists(), proc.communicate(timeout=60)
        assert "--lr must be > 0" in json.loads(error_file.read_text())["message"]["message"]
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=3)  # still there: not gone before rank 0 could print
        proc.send_signal(signal.SIGTERM)  # what torchrun does once rank 0 has exited
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGTERM and out == err == "", err[-2000:]
    finally:
        proc.kill()
        proc.wait(timeout=60)
