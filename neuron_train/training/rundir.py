"""The run directory: checked before torch_xla starts, created last, locked for the run's life.

`preflight` runs every check that needs no torch_xla (~20 s of start-up saved on every refusal):
the output location, the model name, the data (folder images, batch against dataset size), the
checkpoint to resume and whether it fits this run. Only then does rank 0 create the directory and
lock it. What a run directory promises (docs/reliability.md, "Training runs"):

- one run at a time: rank 0 holds an exclusive `flock` on `<run>/.lock` until its process ends
  (the kernel drops it when the process dies, even by kill -9); a second run is refused in one line;
- a new run never writes into a directory holding another run's files;
- a finished run is never rewritten: `--resume` says it is finished and changes nothing, unless
  `--max-steps`/`--epochs` grew;
- a run stopped before its first checkpoint is started again by `--resume` from step 0, its earlier
  files moved to `attempt-N/` (kept, not mixed with the new ones);
- temporary files of a save that never finished are removed at the next start, under the lock;
- a run refused or failed at start-up leaves no empty directory behind (`release_unused`).
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from neuron_train.common import writer
from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.neuron_env import extracting_graphs
from neuron_train.training import checkpoint as ckpt
from neuron_train.training.build import build_data, steps_per_epoch, total_steps
from neuron_train.training.config import RunConfig
from neuron_train.training.data import check_images
from neuron_train.training.device import Backend, check_launch, env_int
from neuron_train.training.models import check_model_name

RUN_FILES = ("summary.json", "metrics.jsonl", "checkpoints", "config.yaml")
LOCK_NAME = ".lock"
_locks: dict[Path, tuple[int, bool]] = {}  # run dir -> (lock file descriptor, this process made the file)
_created: set[Path] = set()    # run dirs this process created (removed again when left empty)


def preflight(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """Every check that needs no torch_xla; then rank 0 creates and locks the run directory.

    Returns the configuration to run (`--resume latest` replaced by the file chosen: the newest good
    one) and a line when `--resume` finds the run finished (nothing to do, nothing changed)."""
    check_launch()  # PJRT_DEVICE names a device here, WORLD_SIZE comes with a launcher
    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    run_dir = Path(cfg.train.output_dir) if cfg.train.output_dir else None
    check_location(run_dir or Path("runs"))
    check_model_name(cfg.model.name)
    total = _target_steps(cfg, world, images=rank == 0)
    if extracting_graphs():  # neuron_parallel_compile's extraction writes nothing: no directory
        return cfg, None
    if run_dir is not None and rank == 0:
        check_run_files(run_dir)  # before the checkpoints are looked at: a FIFO there would hang it
    resume = cfg.checkpoint.resume
    plan = _plan_resume(cfg, resume, run_dir, world, total) if resume is not None else None
    if plan and plan.finished:
        return cfg, plan.finished
    if run_dir is not None and rank == 0:
        _create_and_lock(run_dir)  # a run in progress there is refused now, before anything is said
    if plan is None:
        if run_dir is not None:
            refuse_existing_run(run_dir)
    else:
        for line in plan.notes:
            _note(rank, line)
        if plan.info is not None:  # the file every rank loads; kept in the config
            cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, resume=str(plan.info.path)))
    return cfg, None


def check_location(run_dir: Path) -> None:
    """The run directory must be, or be creatable as, a directory this process can write into."""
    if run_dir.is_symlink() and not run_dir.exists():
        raise UsageError(f"--output-dir {run_dir} is a symbolic link to {os.readlink(run_dir)}, which does not "
                         "exist: create that folder, or choose another --output-dir")
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--output-dir {run_dir} is a file, not a directory: choose another path")
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"--output-dir {run_dir}: {existing} is a file, not a directory: choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):  # also false on a read-only file system
        raise UsageError(f"--output-dir {run_dir}: {existing} is not writable (read-only or no "
                         "permission): choose another --output-dir")


def check_run_files(run_dir: Path) -> None:
    """Before any work: the run folder's own files are what they should be (common.writer's rules):
    the lock and the files we write are absent or regular files, checkpoints/ a real folder whose
    checkpoints and checksums are not links or special files. A link would carry our writes outside
    the run; a FIFO would hang it; a file where checkpoints/ should be would fail at the first save."""
    for name in (LOCK_NAME, *(n for n in RUN_FILES if n != "checkpoints")):
        writer.expect_regular(run_dir / name, f"run's {name}")
    folder = ckpt.checkpoint_dir(run_dir)
    writer.expect_folder(folder, "folder of the run's checkpoints")
    if folder.is_dir():
        for entry in folder.iterdir():
            if not (entry.is_dir() and not entry.is_symlink()):  # a directory by our name is skipped as damage
                writer.expect_regular(entry, "checkpoint file")


def _target_steps(cfg: RunConfig, world: int, *, images: bool) -> int:
    """The run's total optimizer steps; the data is checked on the way (images on rank 0 only)."""
    data = build_data(cfg)
    if images and cfg.data.dataset == "folder" and cfg.data.check_images and cfg.data.data_dir:
        check_images(data, Path(cfg.data.data_dir))  # (a folder dataset always has its --data-dir)
    return total_steps(cfg, steps_per_epoch(cfg, len(data.train), world))


def _run_files(run_dir: Path) -> list[str]:
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def _stopped_before_checkpoint(run_dir: Path) -> bool:
    return (bool(_run_files(run_dir)) and not ckpt.list_checkpoints(run_dir)
            and not (run_dir / "summary.json").exists())


def refuse_existing_run(run_dir: Path) -> None:
    """A new run never writes into another run's directory."""
    found = _run_files(run_dir)
    if not found:
        return
    if _stopped_before_checkpoint(run_dir):
        raise UsageError(f"{run_dir} already holds a run that stopped before its first checkpoint "
                         f"({', '.join(found)}): pass --resume to start it again from step 0 (its "
                         "files are kept in attempt-N/), or choose another --output-dir")
    raise UsageError(f"{run_dir} already holds a run ({', '.join(found)}): pass --resume to continue "
                     "it, or choose another --output-dir")


@dataclass
class _Resume:
    info: ckpt.CheckpointInfo | None   # None: restart a run that stopped before its first checkpoint
    notes: list[str]
    finished: str | None = None


def _plan_resume(cfg: RunConfig, resume: str, run_dir: Path | None, world: int, total: int) -> _Resume:
    """Choose and check the checkpoint to resume from (`resume`: "latest" or a file; reads only); is
    the run already finished?"""
    info: ckpt.CheckpointInfo | None
    notes: list[str]
    if resume != "latest":
        if not Path(resume).is_file():
            raise UsageError(f"--resume: no such checkpoint file: {resume}")
        info, notes = ckpt.inspect(Path(resume)), []
    elif run_dir is None:
        raise UsageError("--resume needs the --output-dir of the run to continue (or --resume FILE)")
    else:
        info, skipped = ckpt.newest_good(run_dir)
        if info is None and skipped:
            raise UsageError(f"--resume: no checkpoint in {ckpt.checkpoint_dir(run_dir)} can be loaded "
                             f"({len(skipped)} tried; the newest: {skipped[0]})")
        if info is None and _stopped_before_checkpoint(run_dir):
            return _Resume(None, [f"{run_dir} holds no checkpoint (the run stopped before its first one): "
                                  f"starting it again from step 0; its files move to "
                                  f"{_next_attempt(run_dir).name}/"])
        if info is None:
            raise UsageError(f"--resume: no checkpoint in {ckpt.checkpoint_dir(run_dir)} (pass "
                             "--output-dir of the run to resume, or --resume FILE)")
        notes = [f"skipping a damaged checkpoint: {line}" for line in skipped]
        if skipped:
            notes.append(f"resuming from {info.path} (step {info.step}), the newest good checkpoint")
    check_fits(info, cfg, world)
    if info.step < total:
        return _Resume(info, notes)
    return _Resume(info, notes, f"{run_dir or info.path} is finished: its checkpoint is at step {info.step} "
                   f"and this run's target is {total} steps; nothing to do, nothing changed (to train "
                   "further, --resume with a larger --max-steps or --epochs)")


def check_fits(info: ckpt.CheckpointInfo, cfg: RunConfig, world: int) -> None:
    """The checkpoint must come from the same model and the same global batch (data position)."""
    m, t = cfg.model, cfg.train
    if (info.model, info.img_size) != (m.name, m.img_size):
        raise UsageError(f"{info.path} is a checkpoint of model {info.model} at --img-size {info.img_size}, "
                         f"this run builds {m.name} at {m.img_size}: resume with --model {info.model} "
                         f"--img-size {info.img_size}")
    ckpt.check_optimizer_layout(info.path, info.zero1_ranks, zero1=cfg.optim.zero1, world_size=world)
    if info.seed is not None and info.seed != t.seed:  # refused, not noted: the data order would differ
        raise UsageError(f"{info.path} was trained with --seed {info.seed}, this run has --seed {t.seed}: the "
                         f"data order would not match; resume with --seed {info.seed}")
    ours = t.batch_size * t.grad_accum * world
    if info.global_batch == ours:
        return
    saved = (f"{info.path} was trained with a global batch of {info.global_batch} ({info.world_size} "
             f"rank(s) x batch {info.batch_size} x accum {info.grad_accum}), this run has {ours} "
             f"({world} x {t.batch_size} x {t.grad_accum}): the data position would not match; ")
    if info.world_size == world:
        raise UsageError(saved + f"resume with --batch-size {info.batch_size} --grad-accum {info.grad_accum}")
    same = info.global_batch % (world * t.grad_accum) == 0
    raise RunError(saved + f"resume with torchrun --standalone --nproc_per_node={info.world_size}"
                   + (f", or keep {world} ranks with --batch-size {info.global_batch // (world * t.grad_accum)}"
                      if same else ""))


def _note(rank: int, line: str) -> None:
    if rank == 0:
        print(f"note: {line}", file=sys.stderr, flush=True)


def _next_attempt(run_dir: Path) -> Path:
    n = 1
    while (run_dir / f"attempt-{n}").exists():
        n += 1
    return run_dir / f"attempt-{n}"


# ----- the lock --------------------------------------------------------------------------------
def hold_lock(run_dir: Path) -> None:
    """Lock `run_dir` for this process's life, or refuse in one line naming the holder."""
    key = run_dir.resolve()
    if key in _locks:
        return
    path = key / LOCK_NAME
    while True:
        fd, made = writer.open_lock(path, "run's lock file")  # never through a link, never a FIFO
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunError(f"{run_dir} is in use by another run ({holder}): wait for it to end, or "
                           "choose another --output-dir") from None
        if path.exists() and os.fstat(fd).st_ino == path.stat().st_ino:
            break
        os.close(fd)  # the file was removed by a run giving the directory up: lock the new one
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%H:%M:%S')}\n".encode())
    _locks[key] = (fd, made)


def _create_and_lock(run_dir: Path) -> None:
    if not run_dir.exists():
        try:
            run_dir.mkdir(parents=True)
            _created.add(run_dir.resolve())
        except FileExistsError:
            pass  # created by a run started at the same moment: the lock decides
        except OSError as exc:
            raise UsageError(f"--output-dir {run_dir}: cannot create it ({exc.strerror})") from None
    hold_lock(run_dir)


def release_unused() -> None:
    """At the end of the command: give up the locks, leaving each directory as this process found
    it or as the run left it. The lock file goes if this process made it (a finished run resumed
    is left byte for byte), and the directory too if this process made it and nothing else is in it
    (a run refused or failed at start-up leaves no empty directory)."""
    for run_dir, (fd, made) in list(_locks.items()):
        if made:
            writer.remove_ours(run_dir / LOCK_NAME)  # before closing: no one locks it meanwhile
        os.close(fd)
        del _locks[run_dir]
        if run_dir in _created:
            writer.remove_folder(run_dir, [])  # only if nothing is in it
        _created.discard(run_dir)


# ----- after start-up --------------------------------------------------------------------------
def open_run_dir(cfg: RunConfig, backend: Backend, extracting: bool) -> tuple[Path, RunConfig]:
    """The run directory, ready for rank 0 to write into (called once torch_xla has started), and
    the configuration to run (a run restarted by --resume trains from step 0: no resume).

    Names the default directory with rank 0's clock; under the lock, removes temporary files of
    saves that never finished and, for a run restarted by --resume, sets the stopped attempt aside."""
    if cfg.train.output_dir:
        run_dir = Path(cfg.train.output_dir)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path(backend.broadcast_object(f"runs/{cfg.model.name}-{stamp}"))
    if extracting:
        backend.barrier()
        return run_dir, cfg
    restart = cfg.checkpoint.resume == "latest" and _stopped_before_checkpoint(run_dir)
    if cfg.checkpoint.resume is None:
        refuse_existing_run(run_dir)
    backend.barrier()  # every rank has looked before rank 0 changes anything
    if backend.is_main:
        _create_and_lock(run_dir)
        stale = ckpt.remove_stale_temps(run_dir)
        if stale:
            _note(0, f"removed {len(stale)} temporary file(s) of a save that never finished: "
                     f"{', '.join(p.name for p in stale[:3])}")
        if restart:
            _set_aside(run_dir)
    if restart:
        cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, resume=None))
    backend.barrier()
    return run_dir, cfg


def _set_aside(run_dir: Path) -> Path:
    """Move the files of an attempt that stopped before its first checkpoint into attempt-N/."""
    dest = _next_attempt(run_dir)
    dest.mkdir()
    for entry in run_dir.iterdir():
        if entry.name not in (LOCK_NAME, "checkpoints") and not entry.name.startswith("attempt-"):
            entry.rename(dest / entry.name)
    return dest
