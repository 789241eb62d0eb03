"""Checkpoints: rank 0 writes atomically (temp file, fsync, rename), keeps the last K, loads safely.

A checkpoint holds everything a resumed run needs to continue as if never stopped: model,
optimizer, step, data position (epoch, batch within it), RNG states and the run's configuration
(which names the model it is from). Loading uses `weights_only=True`, so a checkpoint file cannot
run code, and every file that cannot be loaded is said in one line (never with advice to load it
unsafely: a file we did not write must not run code).

A save that fails removes its temporary file (a full disk names the last good checkpoint); one
killed mid-save leaves `.step-N.pt.tmp-HOST-PID`, removed at the run's next start (`remove_stale_temps`).
Each file is written with its SHA-256 beside it and checked before use; a file that loads is also
checked for everything a resume reads (checkpoint_format.py). A damaged newest checkpoint (cut
short, bytes changed, wrong structure) is skipped for the newest good one (`newest_good`).
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_map

from neuron_train.common import reader, writer
from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.fileio import work_path
from neuron_train.training import checkpoint_format as fmt

FORMAT = 1
_NAME = re.compile(r"^step-(\d{8})\.pt$")
_TEMP = re.compile(r"^\.step-\d{8}(\.optim-rank\d+)?\.pt(\.sha256)?\.tmp-(.+-)?\d+$")  # work_path names, and older ones
# common.writer's temporary files of the run folder's own files (tempfile.mkstemp: 8 random characters)
_RUN_TEMP = re.compile(r"^\.(summary\.json|graphs\.json|config\.yaml|metrics\.jsonl|precompile_coverage\.json"
                       r"|profile\.json)\.[a-z0-9_]+\.tmp$")
_SIDECAR = re.compile(r"^(step-\d{8}(\.optim-rank\d+)?\.pt)\.sha256$")
_T = TypeVar("_T")  # a nested structure of tensors and other values
_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"  # pickled magic number of old torch.save files


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def to_cpu(obj: _T) -> _T:
    """Copy every tensor in a nested structure to the host (a device->host transfer per tensor)."""
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, obj)


def rng_state() -> dict:
    import torch_xla.core.xla_model as xm

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "xla": xm.get_rng_state()}


def set_rng_state(state: dict) -> None:
    import torch_xla.core.xla_model as xm

    try:
        torch.set_rng_state(state["torch"])
        random.setstate(_as_tuple(state["python"]))
    except (TypeError, ValueError, RuntimeError) as exc:  # types are checked before; contents here
        raise UsageError(f"the checkpoint's RNG state is damaged ({str(exc)[:120]}): resume from "
                         "another checkpoint") from None
    xm.set_rng_state(int(state["xla"]))


def _as_tuple(x: object) -> Any:  # x with every list a tuple, at any depth (random.setstate's form)
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def list_checkpoints(run_dir: Path) -> list[Path]:
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _NAME.match(p.name) and p.is_file())


def _remove_file(path: Path) -> None:
    """Delete a file of ours by its name; anything else by that name (a directory) is not ours: kept."""
    writer.remove_ours(path)


def _step_file(run_dir: Path, step: int) -> Path:
    if step < 0:  # a position read from a file is checked before; this is the last guard
        raise RunError(f"cannot save a checkpoint at step {step}: steps are >= 0")
    return checkpoint_dir(run_dir) / f"step-{step:08d}.pt"


def shard_file(checkpoint: Path, rank: int) -> Path:
    """Rank `rank`'s ZeRO-1 optimizer shard beside `step-N.pt`: `step-N.optim-rank{rank}.pt`."""
    return checkpoint.with_name(f"{checkpoint.stem}.optim-rank{rank}.pt")


def _write_atomic(final: Path, state: dict) -> None:
    """`state` as `final`, whole or not at all: on any failure the temporary file is removed."""
    final.parent.parent.mkdir(parents=True, exist_ok=True)  # the run folder (the user's choice)
    writer.make_folders(final.parent.parent, Path(final.parent.name))  # checkpoints/ ours: never a link
    tmp = work_path(final, "tmp")  # .step-N.pt.tmp-HOST-PID
    side, side_tmp = fmt.checksum_file(final), work_path(fmt.checksum_file(final), "tmp")
    try:
        with os.fdopen(writer.create_new(tmp), "wb") as fh:
            torch.save({"format": FORMAT, **state}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        with os.fdopen(writer.create_new(side_tmp), "w") as fh:  # hashed from the disk: what a reader checks
            fh.write(fmt.checksum_line(tmp, final.name))
            fh.flush()
            os.fsync(fh.fileno())
        writer.rename_over(side_tmp, side, "checksum file")  # the checksum first: never a checkpoint without one
        writer.rename_over(tmp, final, "checkpoint")  # atomic: a reader sees the old set or the complete new file
    except BaseException as exc:
        writer.remove_ours(tmp)
        writer.remove_ours(side_tmp)
        failed = write_failed_in_run(final.parent.parent, final, exc)
        if failed is not None:
            writer.remove_ours(side)
            raise failed from None
        raise


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed save: torch's zip writer turns a failed write of the file object
    into `RuntimeError: [enforce fail at inline_container.cc...]`, the OSError left as its context."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, RuntimeError) and isinstance(exc.__context__, OSError):
        return exc.__context__
    return None


def write_failed_in_run(run_dir: Path, path: Path, exc: BaseException, lost: str = "") -> RunError | None:
    """The one line for a file of the run that could not be written (a checkpoint, metrics.jsonl,
    summary.json, graphs.json), or None when `exc` is no failed write: a full disk says
    `no space left on DIR`, and the line names the last good checkpoint to continue from.
    `lost` says what was not written (default: "NAME was not saved")."""
    cause = _os_error(exc)
    if cause is None:
        return None
    good = [p for p in list_checkpoints(run_dir) if p != path]
    last = f"the last good checkpoint is {good[-1]}" if good else "no checkpoint was saved before"
    lost = lost or f"{path.name} was not saved"
    if cause.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(path.parent).free / 2**20
        return RunError(f"no space left on {path.parent} ({free:.0f} MiB free): {lost}; {last}; "
                        "free some space, then continue with --resume")
    return RunError(f"cannot write {path}: {cause.strerror or cause}: {lost}; {last}")


def save(run_dir: Path, step: int, state: dict, keep_last: int) -> Path:
    """Write `state` (already on the host) as checkpoints/step-NNNNNNNN.pt; delete the oldest beyond K.

    With ZeRO-1 every rank has written its optimizer shard first (`save_shard`): the main file,
    written last, is what makes the set a checkpoint, and shards are pruned with it.
    """
    final = _step_file(run_dir, step)
    _write_atomic(final, state)
    kept = list_checkpoints(run_dir)[-keep_last:]
    for old in list_checkpoints(run_dir)[:-keep_last]:
        _remove_file(old)
        _remove_file(fmt.checksum_file(old))
    kept_stems = {p.stem for p in kept}
    for shard in checkpoint_dir(run_dir).glob("step-*.optim-rank*.pt"):
        if shard.name.split(".")[0] not in kept_stems:  # pruned, or left by a crash mid-save
            _remove_file(shard)
            _remove_file(fmt.checksum_file(shard))
    return final


def save_shard(run_dir: Path, step: int, rank: int, state: dict) -> Path:
    """Write this rank's ZeRO-1 optimizer state (already on the host) beside step `step`."""
    final = shard_file(_step_file(run_dir, step), rank)
    _write_atomic(final, state)
    return final


def remove_stale_temps(run_dir: Path) -> list[Path]:
    """Delete what writes that never finished left (a process killed mid-save): checkpoint temporary
    files and checksums without their checkpoint, and common.fileio's atomic-write temporary files
    (`.NAME.XXXX.tmp`) in the run directory.

    Call only while holding the run directory's lock: then no write of ours is in progress."""
    d = checkpoint_dir(run_dir)
    names = [p for p in d.iterdir()] if d.is_dir() else []
    stale = [p for p in names if _TEMP.match(p.name)
             or ((m := _SIDECAR.match(p.name)) and not (d / m[1]).exists())]
    ours = [p for p in Path(run_dir).glob(".*.tmp") if _RUN_TEMP.match(p.name)]  # only names we make
    stale = [p for p in stale + ours if p.is_symlink() or p.is_file()]
    for p in stale:
        _remove_file(p)
    return stale


def sharded_marker(world_size: int) -> dict:
    """What the main checkpoint holds as "optimizer" when each rank saved its own shard."""
    return {"sharded": "zero1", "world_size": world_size}


def check_optimizer_layout(path: Path, zero1_ranks: int | None, *, zero1: bool, world_size: int) -> None:
    """A checkpoint's optimizer state must have this run's layout (`zero1_ranks`: None if not sharded)."""
    if (zero1_ranks is not None) != zero1:
        how = f"with --zero1 on {zero1_ranks} ranks" if zero1_ranks else "without --zero1"
        raise UsageError(f"{path} was saved {how}: resume it the same way (the optimizer state "
                         "layout differs)")
    if zero1_ranks is not None and zero1_ranks != world_size:
        raise UsageError(f"{path} holds ZeRO-1 optimizer shards of {zero1_ranks} ranks, this run has "
                         f"{world_size}: resume with torchrun --standalone --nproc_per_node={zero1_ranks}")


def optimizer_state(path: Path, state: dict, *, zero1: bool, world_size: int, rank: int) -> dict:
    """The optimizer state this rank resumes from: the full one in `path`, or its ZeRO-1 shard."""
    saved = state["optimizer"]
    sharded = saved.get("sharded") == "zero1"
    check_optimizer_layout(path, saved["world_size"] if sharded else None, zero1=zero1, world_size=world_size)
    if not sharded:
        return saved
    shard = shard_file(path, rank)
    if not shard.is_file():
        raise UsageError(f"--resume: {shard} is missing (each rank's ZeRO-1 optimizer shard is saved "
                         f"beside {path.name})")
    return {k: v for k, v in load(shard).items() if k != "format"}


def resolve(run_dir: Path, resume: str) -> Path:
    """`--resume` (latest in the run dir) or `--resume FILE` -> the checkpoint file to load.

    `latest` is normally made concrete before start-up (training/rundir.py picks the newest good
    checkpoint and says which); here it is the newest by name."""
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


# ----- reading ---------------------------------------------------------------------------------
def read(path: Path, what: str, *, mmap: bool = False) -> object:
    """`torch.load(path, weights_only=True)` on the host; any failure is one UsageError line.

    `mmap=True` maps tensors instead of reading them: a cheap look at a checkpoint's metadata."""
    path = Path(path)
    damage = checked_file(path, what)
    if damage and zipfile.is_zipfile(path):
        raise UsageError(f"{what} {path}: {damage}")
    if damage:  # a cut-short or overwritten file: torch's failure says more than the checksum
        raise UsageError(f"{what} {path}: {_why_unloadable(path, ValueError(damage))}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # the user's file: said in one line, whatever torch raised
        raise UsageError(f"{what} {path}: {_why_unloadable(path, exc)}") from None
    if not fmt.checksum_file(path).is_file():
        _note_unverified(path)
    return state


def checked_file(path: Path, what: str) -> str | None:
    """Before a loader reads a byte: `path` must be a regular file (a FIFO or a device would block
    or never end: one line); returns what is wrong with it against its `.sha256` (None: nothing)."""
    try:
        reader.regular_file(path)
        return fmt.checksum_problem(path)
    except UsageError as exc:
        raise UsageError(f"{what} {exc}") from None
    except OSError as exc:
        raise UsageError(f"{what} {path}: cannot read it ({exc.strerror})") from None


_NOTED: set[Path] = set()  # files already noted as unverified (a file is read more than once a run)


def _note_unverified(path: Path) -> None:
    """A file without its `.sha256` (saved by an older version, or copied alone) is used, unverified,
    with a note (once per file, by rank 0). No checksum is written for it: we did not see it written."""
    if path.resolve() in _NOTED or os.environ.get("RANK", "0") != "0":
        return
    _NOTED.add(path.resolve())
    print(f"note: {path} has no {fmt.checksum_file(path).name} beside it (saved by an older neuron-train, "
          "or copied without it): loaded without a checksum check; copy the .sha256 file with it to have "
          "it verified", file=sys.stderr, flush=True)


def _why_unloadable(path: Path, exc: Exception) -> str:
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(len(_LEGACY_MAGIC))
    except OSError as err:
        return f"cannot read it ({err.strerror})"
    if size == 0:
        return "the file is empty (0 bytes)"
    found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+)", str(exc))
    if found:  # a pickle that would call a function: never load it
        return f"holds Python objects, not only tensors ({found[1]}): refused, loading it could run code"
    if head.startswith(b"PK\x03\x04"):  # torch.save's zip archive
        if not zipfile.is_zipfile(path):
            return f"truncated ({size} bytes): the archive ends before its index (an interrupted save or copy)"
        return "a damaged torch.save archive: " + _reason(exc)
    if head == _LEGACY_MAGIC:
        return "a damaged file in the old torch.save format: " + _reason(exc)
    return "not a checkpoint or state dict (not a file written by torch.save)"


def _reason(exc: Exception) -> str:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return type(exc).__name__ if "weights_only" in first else first


def load(path: Path) -> dict:
    return _ours(path, read(path, "cannot load checkpoint"))


def _ours(path: Path, state: object) -> dict:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"{path} is not a neuron_train checkpoint (format {FORMAT}): to start from "
                         "its weights, pass it as --pretrained instead of --resume")
    return state


def load_resumable(path: Path) -> dict:
    """`load`, then everything a resume reads is checked (one line naming the first problem)."""
    state = load(path)
    _check_structure(path, state)
    return state


def _check_structure(path: Path, state: dict) -> None:
    problem = fmt.structure_problem(state)
    if problem:
        raise UsageError(f"{path} cannot be resumed: {problem} (a damaged file, or not saved by neuron_train)")


@dataclass
class CheckpointInfo:
    """What a checkpoint says about the run that saved it, read without loading its tensors."""

    path: Path
    step: int
    global_batch: int
    world_size: int
    model: str
    img_size: int
    batch_size: int
    grad_accum: int
    zero1_ranks: int | None  # saved with --zero1: the ranks whose optimizer shards it holds
    seed: int | None = None  # the data order depends on it (None: not recorded)


def inspect(path: Path) -> CheckpointInfo:
    # mmap only works on (complete) zip archives, the format we write; anything else is read
    # normally so that its error message is the accurate one.
    state = read(path, "cannot load checkpoint", mmap=zipfile.is_zipfile(path))
    state = _ours(path, state)
    _check_structure(path, state)
    cfg = state["config"]
    batch, accum = cfg["train"]["batch_size"], cfg["train"]["grad_accum"]
    optim = state["optimizer"]
    return CheckpointInfo(path=path, step=state["position"]["step"], global_batch=state["global_batch"],
                          world_size=state["global_batch"] // (batch * accum), model=cfg["model"]["name"],
                          img_size=cfg["model"]["img_size"], batch_size=batch, grad_accum=accum,
                          zero1_ranks=optim["world_size"] if optim.get("sharded") == "zero1" else None,
                          seed=cfg["train"].get("seed") if isinstance(cfg["train"].get("seed"), int) else None)


def newest_good(run_dir: Path) -> tuple[CheckpointInfo | None, list[str]]:
    """The newest checkpoint that loads, and one line per newer one skipped (truncated, damaged)."""
    skipped: list[str] = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return inspect(path), skipped
        except UsageError as exc:
            skipped.append(str(exc))
    return None, skipped


def load_model_state(model: torch.nn.Module, state: dict, path: Path) -> None:
    """`model.load_state_dict(state["model"])`, a mismatch said in one line naming the file's model."""
    mismatch = fmt.describe_mismatch(state["model"], model.state_dict())
    if mismatch:
        raise UsageError(f"{path} does not fit this model: {mismatch} weights; it is from "
                         f"{fmt.origin(state)}: resume with the same --model, --img-size and classes")
    model.load_state_dict(state["model"])
