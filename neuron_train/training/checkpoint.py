"""Checkpoints: rank 0 writes atomically (temp file, fsync, rename), keeps the last K, loads safely.

A checkpoint holds everything a resumed run needs to continue as if never stopped: model,
optimizer, step, data position (epoch, batch within it) and RNG states. Loading uses
`weights_only=True`, so a checkpoint file cannot run code.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import torch
from torch.utils._pytree import tree_map

from neuron_train.common.errors import UsageError

FORMAT = 1
_NAME = re.compile(r"^step-(\d{8})\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def to_cpu(obj):
    """Copy every tensor in a nested structure to the host (a device->host transfer per tensor)."""
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, obj)


def rng_state() -> dict:
    import torch_xla.core.xla_model as xm

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "xla": xm.get_rng_state()}


def set_rng_state(state: dict) -> None:
    import torch_xla.core.xla_model as xm

    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    xm.set_rng_state(int(state["xla"]))


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def list_checkpoints(run_dir: Path) -> list[Path]:
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _NAME.match(p.name))


def _step_file(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:08d}.pt"


def shard_file(checkpoint: Path, rank: int) -> Path:
    """Rank `rank`'s ZeRO-1 optimizer shard beside `step-N.pt`: `step-N.optim-rank{rank}.pt`."""
    return checkpoint.with_name(f"{checkpoint.stem}.optim-rank{rank}.pt")


def _write_atomic(final: Path, state: dict) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        torch.save({"format": FORMAT, **state}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)  # atomic: a reader sees the old set or the complete new file


def save(run_dir: Path, step: int, state: dict, keep_last: int) -> Path:
    """Write `state` (already on the host) as checkpoints/step-NNNNNNNN.pt; delete the oldest beyond K.

    With ZeRO-1 every rank has written its optimizer shard first (`save_shard`): the main file,
    written last, is what makes the set a checkpoint, and shards are pruned with it.
    """
    final = _step_file(run_dir, step)
    _write_atomic(final, state)
    kept = list_checkpoints(run_dir)[-keep_last:]
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink()
    kept_stems = {p.stem for p in kept}
    for shard in checkpoint_dir(run_dir).glob("step-*.optim-rank*.pt"):
        if shard.name.split(".")[0] not in kept_stems:  # pruned, or left by a crash mid-save
            shard.unlink()
    return final


def save_shard(run_dir: Path, step: int, rank: int, state: dict) -> Path:
    """Write this rank's ZeRO-1 optimizer state (already on the host) beside step `step`."""
    final = shard_file(_step_file(run_dir, step), rank)
    _write_atomic(final, state)
    return final


def sharded_marker(world_size: int) -> dict:
    """What the main checkpoint holds as "optimizer" when each rank saved its own shard."""
    return {"sharded": "zero1", "world_size": world_size}


def optimizer_state(path: Path, state: dict, *, zero1: bool, world_size: int, rank: int) -> dict:
    """The optimizer state this rank resumes from: the full one in `path`, or its ZeRO-1 shard."""
    saved = state["optimizer"]
    sharded = saved.get("sharded") == "zero1"
    if sharded != zero1:
        how = f"with --zero1 on {saved['world_size']} ranks" if sharded else "without --zero1"
        raise UsageError(f"{path} was saved {how}: resume it the same way (the optimizer state "
                         "layout differs)")
    if not sharded:
        return saved
    if saved["world_size"] != world_size:
        raise UsageError(f"{path} holds ZeRO-1 optimizer shards of {saved['world_size']} ranks, "
                         f"this run has {world_size}: resume on {saved['world_size']} ranks")
    shard = shard_file(path, rank)
    if not shard.is_file():
        raise UsageError(f"--resume: {shard} is missing (each rank's ZeRO-1 optimizer shard is saved "
                         f"beside {path.name})")
    return {k: v for k, v in load(shard).items() if k != "format"}


def resolve(run_dir: Path, resume: str) -> Path:
    """`--resume` (latest in the run dir) or `--resume FILE` -> the checkpoint file to load."""
    if resume != "latest":
        path = Path(resume)
        if not path.is_file():
            raise UsageError(f"--resume: no such checkpoint file: {resume}")
        return path
    found = list_checkpoints(run_dir)
    if not found:
        raise UsageError(f"--resume: no checkpoint in {checkpoint_dir(run_dir)} (pass --output-dir "
                         "of the run to resume, or --resume FILE)")
    return found[-1]


def load(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated/corrupt/foreign file: the user's input, said in one line
        raise UsageError(f"cannot load checkpoint {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"{path} is not a neuron_train checkpoint (format {FORMAT})")
    return state
