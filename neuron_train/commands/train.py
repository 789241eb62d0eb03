"""`neuron-train train` / `torchrun neuron_train/run.py`: parse, check, build, train, print the summary.

Exit codes: 0 trained (or `--resume` of a finished run: nothing to do, nothing changed), 2 bad
input (UsageError), 1 refused or failed run (RunError). Everything that can be checked without
torch_xla is checked before it starts (training/rundir.py). Under torchrun, the error line is also
handed to torchrun (TORCHELASTIC_ERROR_FILE), whose failure report then shows it instead of
"To enable traceback see ..."; errors found before start-up are printed by local rank 0 only
(every rank finds the same one; the others wait until torchrun stops them, which it does to every
rank at the first exit: rank 0's, after its line).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.fileio import unusable_path, write_json_atomic
from neuron_train.precompile.store import open_cache
from neuron_train.training import rundir
from neuron_train.training.config_io import add_config_arguments, config_from_args
from neuron_train.training.summary import RunSummary

# How long a quiet rank waits for torchrun to stop it: only reached if local rank 0 went on (an
# error only this rank found); then this rank exits and torchrun stops the rest.
_QUIET_RANK_DEADLINE_S = 60.0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Train a timm model with PyTorch/XLA: on NeuronCores when present, else on "
                          "the CPU XLA device. Launch several processes with torchrun.")
    add_config_arguments(parser)


def _format_summary(s: RunSummary) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    lines = [
        f"run        {s.run_dir}",
        f"model      {s.model} ({s.params / 1e6:.2f} M params), {s.precision}, "
        f"{s.device} x {s.world_size} rank(s), global batch {s.global_batch_size}",
        f"steps      {s.steps} ({s.epochs} epochs), final loss {num(s.final_loss, '.4f')}",
        f"eval       accuracy {num(s.eval_accuracy, '.4f')}, loss {num(s.eval_loss, '.4f')}"
        + (f"; EMA accuracy {num(s.eval_ema_accuracy, '.4f')}, loss {num(s.eval_ema_loss, '.4f')}"
           if s.eval_ema_accuracy is not None else ""),
        f"speed      {num(s.samples_per_sec, '.1f')} samples/s, " + (
            f"step {s.step_time_ms_median:.1f} ms median" if s.step_time_ms_median is not None
            else "step time n/a (too few steady steps to time one: raise --max-steps)")
        + f" (after {s.warmup_steps_excluded} warm-up steps)",
        f"graphs     {s.compile_count} compiled in {s.compile_time_s:.1f} s",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        return _train(args)
    except (UsageError, RunError) as exc:
        _tell_torchrun(exc)
        raise
    except (OSError, RuntimeError) as exc:
        usage = unusable_path(exc)  # a path no command can use: neuron_train.cli prints the line
        if usage is not None:
            _tell_torchrun(usage)
        raise
    finally:
        rundir.release_unused()  # a run that wrote nothing leaves no empty directory


def _tell_torchrun(exc: Exception) -> None:
    """Give torchrun our one line for its failure report (the format torch's ErrorHandler writes)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    line = f"neuron-train train: {'error: ' if isinstance(exc, UsageError) else ''}{exc}"
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                       "timestamp": str(int(time.time()))}}}
    try:
        write_json_atomic(Path(path), data)
    except (OSError, RunError):  # a full disk, a FIFO or a link by that name: never written through
        pass  # torchrun then says less; our own line is still printed


def _wait_to_be_stopped() -> None:
    """Sync point with torchrun for a quiet rank: torchrun stops every rank at the first exit, so a
    quiet rank that exited first could have rank 0 stopped before it printed the line. It waits for
    the event that ends it instead, torchrun's SIGTERM once rank 0 has printed and exited (bounded by
    _QUIET_RANK_DEADLINE_S). Without torchrun (TORCHELASTIC_RUN_ID unset) no one stops the others."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        threading.Event().wait(_QUIET_RANK_DEADLINE_S)


def _train(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        if cfg.compile.compile_cache:
            open_cache(cfg.compile.compile_cache)  # the cache's one door, before the run folder is made
        cfg, finished = rundir.preflight(cfg)  # before torch_xla starts: refusals take seconds, not ~20 s
    except (UsageError, RunError, OSError, RuntimeError) as exc:
        if not isinstance(exc, (UsageError, RunError)) and unusable_path(exc) is None:
            raise
        if os.environ.get("LOCAL_RANK", "0") != "0":  # the same line as local rank 0's: said once
            _tell_torchrun(exc)
            _wait_to_be_stopped()
            sys.exit(1 if isinstance(exc, RunError) else 2)
        raise
    if finished:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(finished, flush=True)
        return 0
    from neuron_train.training.device import init_backend, resolve_precision

    cfg = resolve_precision(cfg)
    from neuron_train.precompile.cache_env import warn
    from neuron_train.training.cache_hook import point_compiler_at_cache

    note = point_compiler_at_cache(cfg.compile.compile_cache)  # before the device client starts
    if note and os.environ.get("LOCAL_RANK", "0") == "0":
        warn(note)  # said here: by the loop's cache hook, the flag is already ours
    from neuron_train.graphs import prepare_process

    prepare_process(check=cfg.compile.check_graphs)  # torch_xla reads its debug settings only once
    backend = init_backend()  # imports torch_xla: after the environment is set
    from neuron_train.training.loop import train

    try:
        summary = train(cfg, backend)
    finally:
        backend.close()
    if backend.is_main:
        print(_format_summary(summary), flush=True)
    return 0
