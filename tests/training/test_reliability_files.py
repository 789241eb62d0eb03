"""Issue 31 (reliability round 4), in-process: the files of a training run. A directory where a
checkpoint or its `.sha256` should be, crafted `--pretrained` / `--teacher-checkpoint` contents,
sidecars in every form `sha256sum -c` accepts, special files where a checkpoint is expected, and
the order of a save's two renames. Each test was seen failing with its rule removed."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
import torch

from neuron_train.common.errors import UsageError
from neuron_train.training import checkpoint as ckpt
from neuron_train.training import models
from neuron_train.training.checkpoint_format import checksum_file, checksum_line
from tests.training.test_reliability_train import save_checkpoint


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def within(seconds: float, call):
    """`call()` in a thread: its result or exception, or a failure if it blocks (a FIFO's open)."""
    box: dict = {}

    def target():
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


# ----------------------------------------------------------------------------- directories by our names


def test_a_directory_by_an_old_checkpoints_or_sidecars_name_survives_keep_last_pruning(tmp_path):
    """Bad row 2: names were matched, types were not (IsADirectoryError at a save's pruning)."""
    d = ckpt.checkpoint_dir(tmp_path)
    (d / "step-00000000.pt").mkdir(parents=True)           # sorts first: the oldest "checkpoint"
    first = save_checkpoint(tmp_path, 1)
    checksum_file(first).unlink()
    checksum_file(first).mkdir()                             # a directory where a sidecar should be
    for step in range(2, 8):
        save_checkpoint(tmp_path, step)                      # keep_last=5: steps 1 and 2 are pruned
    assert (d / "step-00000000.pt").is_dir() and checksum_file(first).is_dir()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [f"step-{s:08d}.pt" for s in range(3, 8)]


def test_start_up_cleanup_keeps_a_directory_by_a_stale_sidecars_name(tmp_path):
    d = ckpt.checkpoint_dir(tmp_path)
    (d / "step-00000009.pt.sha256").mkdir(parents=True)     # no step-9 checkpoint: "stale" by name
    (d / ".step-00000009.pt.tmp-host-1").mkdir()
    stale_file = d / "step-00000008.pt.sha256"
    stale_file.write_text("x\n")
    assert ckpt.remove_stale_temps(tmp_path) == [stale_file]
    assert (d / "step-00000009.pt.sha256").is_dir() and (d / ".step-00000009.pt.tmp-host-1").is_dir()


def test_a_sidecar_that_is_a_directory_is_damage_not_a_missing_checksum(tmp_path):
    path = save_checkpoint(tmp_path, 1)
    checksum_file(path).unlink()
    checksum_file(path).mkdir()
    with pytest.raises(UsageError, match="checksum file cannot be used .*is a directory, not a regular file"):
        ckpt.load(path)


# ----------------------------------------------------------------------------- sidecar forms


@pytest.mark.parametrize("form", ["{hex}  {name}\n", "{HEX}  {name}\n", "{hex} *{name}\n", "SHA256 ({name}) = {hex}\n",
                                  "SHA256 ({name}) = {HEX}\n"])
def test_every_sidecar_form_sha256sum_accepts_is_checked(tmp_path, form):
    path = save_checkpoint(tmp_path, 1)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    checksum_file(path).write_text(form.format(hex=digest, HEX=digest.upper(), name=path.name))
    assert ckpt.load(path)["position"]["step"] == 1
    checksum_file(path).write_text(form.format(hex="0" * 64, HEX="0" * 64, name=path.name))
    with pytest.raises(UsageError, match="SHA-256 differs"):
        ckpt.load(path)


def test_a_sidecar_without_a_sha256_line_is_damage(tmp_path):
    path = save_checkpoint(tmp_path, 1)
    checksum_file(path).write_text("not a checksum\n")
    with pytest.raises(UsageError, match="holds no SHA-256 line"):
        ckpt.load(path)


# ----------------------------------------------------------------------------- crafted contents


def crafted(tmp_path: Path, config: object) -> Path:
    path = tmp_path / "weights.pt"
    torch.save({"model": {"other.weight": torch.zeros(3)}, "config": config}, path)
    checksum_file(path).write_text(checksum_line(path, path.name))  # a valid sidecar: the contents are the attack
    return path


@pytest.mark.parametrize("config", [{"model": "vit"}, {}, {"model": {"name": 3, "img_size": "big"}},
                                    {"model": {"name": "x" * 100_000, "img_size": 32}}])
def test_crafted_pretrained_metadata_is_validated_like_a_file_format(tmp_path, config):
    """Bad row 3: `config.model` a string was a TypeError, no `model` a KeyError (checkpoint_format.origin)."""
    path = crafted(tmp_path, config)
    with pytest.raises(UsageError) as err:
        models.load_weights(torch.nn.Linear(2, 2), path)     # --pretrained; --teacher-checkpoint reads the same
    line = str(err.value)
    assert "no weight matches" in line and "\n" not in line and len(line) < 600


def test_a_safetensors_file_is_checked_against_its_sidecar(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, str(path))
    checksum_file(path).write_text(f"{'0' * 64}  {path.name}\n")
    with pytest.raises(UsageError, match="SHA-256 differs"):
        models.load_weights(torch.nn.Linear(2, 2), path)
    checksum_file(path).write_text(checksum_line(path, path.name))
    assert models.load_weights(torch.nn.Linear(2, 2), path)[0] == []


# ----------------------------------------------------------------------------- special files


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_special_file_where_weights_are_expected_is_one_line_at_once(tmp_path, kind):
    """Bad row 8: a FIFO never hangs, a device is never read without bound."""
    fifo = tmp_path / "w.pt"
    if kind == "fifo":
        os.mkfifo(fifo)
    elif kind == "directory":
        fifo.mkdir()
    path = {"fifo": fifo, "directory": fifo, "device": Path("/dev/zero")}[kind]
    for call in (lambda: models.read_state_dict(path), lambda: ckpt.load(path)):
        with pytest.raises(UsageError, match="not a regular file"):
            within(10, call)


# ----------------------------------------------------------------------------- the two renames


class Killed(BaseException):
    """A kill between two instructions: no cleanup of ours runs for it (not an OSError)."""


def test_a_kill_between_the_two_renames_never_leaves_a_checkpoint_without_its_checksum(tmp_path, monkeypatch):
    """Mutant: the renames swapped. The checksum takes its name first, so a kill after the first
    rename leaves a checksum without its checkpoint (removed at the next start), never a checkpoint
    that would be loaded unverified."""
    save_checkpoint(tmp_path, 1)
    real, calls = os.replace, []

    def replace_then_die(src, dst):
        calls.append(Path(dst).name)
        if len(calls) == 2:
            raise Killed
        real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace_then_die)
    with pytest.raises(Killed):
        save_checkpoint(tmp_path, 2)
    monkeypatch.setattr(ckpt.os, "replace", real)
    for path in ckpt.list_checkpoints(tmp_path):
        assert checksum_file(path).is_file(), f"{path.name} has no checksum"
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000001.pt"]
    ckpt.remove_stale_temps(tmp_path)
    assert sorted(p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir()) == [
        "step-00000001.pt", "step-00000001.pt.sha256"]
