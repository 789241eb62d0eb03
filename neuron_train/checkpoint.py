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

from neuron_train.errors import UsageError

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


def save(run_dir: Path, step: int, state: dict, keep_last: int) -> Path:
    """Write `state` (already on the host) as checkpoints/step-NNNNNNNN.pt; delete the oldest beyond K."""
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"step-{step:08d}.pt"
    tmp = d / f".{final.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        torch.save({"format": FORMAT, **state}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)  # atomic: a reader sees the old set or the complete new file
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink()
    return final


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
