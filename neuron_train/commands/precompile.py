"""`neuron-train precompile`: compile every graph of a run ahead of it, then prove the run needed no more.

Two kinds of run, one machinery (the manifest records of cache_env.record_graphs, coverage.py, store.py),
one plan printer (cache_env.format_plan):

- neuron-train's own loop (`-- TRAIN_ARGS`, e.g. `-- --model vit-nano`): the loop in "graph tour"
  mode (precompile/loop_precompile.py). A later `train --compile-cache DIR` reports its coverage and,
  with `--require-precompiled`, refuses a configuration that was not precompiled (naming the
  difference, e.g. "batch size 64 here, 32 in the manifest");
- any other command (`-- python my_train.py ARGS`, `-- torchrun ... my_train.py`): the command
  itself is the tour (precompile/script_precompile.py), checked later by `check-graphs --compile-cache DIR`.

On Neuron, neuron_parallel_compile compiles the extracted graphs in parallel into the Neuron cache.
This module parses the options, reads the run's configuration and runs the plan.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

from neuron_train.common.cli_parser import add_cache_option
from neuron_train.common.errors import UsageError
from neuron_train.instrument.script import RETRIES_ENV, checked_command
from neuron_train.precompile import store
from neuron_train.precompile.cache_env import TourPlan, check_cache, format_plan, network_fs_warning, warn
from neuron_train.precompile.loop_precompile import LoopPlan, execute_loop_plan, plan_loop
from neuron_train.precompile.script_precompile import (
    DEFAULT_STEPS,
    execute_script_plan,
    plan_script,
    script_device,
)
from neuron_train.training.cache_hook import tour_steps
from neuron_train.training.config import RunConfig
from neuron_train.training.config_io import config_from_train_args

_USAGE = ("neuron-train precompile [options] -- TRAIN_ARGS ...   (neuron-train's own loop)\n"
          "       neuron-train precompile [options] -- COMMAND [ARGS...]   (any PyTorch/XLA script)")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.usage = _USAGE
    parser.description = ("Precompile every graph of a training run into the compile cache and record "
                          "a graph manifest there. TRAIN_ARGS are the arguments of the real "
                          "`neuron-train train` run, unchanged; or give any PyTorch/XLA command "
                          "(`-- python my_train.py ARGS`, `-- torchrun ... my_train.py ARGS`), then check "
                          "its real run with `neuron-train check-graphs --compile-cache DIR -- COMMAND`.")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and environment; run nothing")
    add_cache_option(parser, help=f"compile cache directory (default: --compile-cache in TRAIN_ARGS, else "
                     f"{store.DEFAULT_CACHE_DIR}); one per host")
    parser.add_argument("--steps", type=int, metavar="N", help=f"COMMAND: stop the tour once every call site "
                        f"is warm and at least N steps ran (0: run the command to its end; default: run to the end "
                        f"of the first epoch and through its evaluation/checkpoint, at least {DEFAULT_STEPS} steps, "
                        "when a DataLoader feeds the steps); TRAIN_ARGS: the same as --precompile-steps N")
    parser.add_argument("--num-parallel", type=int, metavar="N", help="graphs neuron_parallel_compile "
                        "compiles at once (default: its own choice; lower it when hosts run out of memory)")
    parser.add_argument("--nproc-per-node", type=int, default=1, metavar="W", help="TRAIN_ARGS only: processes "
                        "of the real run (torchrun --nproc_per_node); the world size is part of every graph "
                        "(default: 1). A COMMAND starts its own processes")
    parser.add_argument("--retries", type=int, default=1, metavar="N", help=f"retries of a failed compile "
                        f"({RETRIES_ENV}; default: 1)")
    parser.add_argument("--retry-failed", action="store_true", help="recompile graphs the cache holds as "
                        "failed compiles (NEURON_CC_FLAGS --retry_failed_compilation)")
    parser.add_argument("--target", choices=("auto", "neuron", "cpu"), default="auto", help="neuron: under "
                        "neuron_parallel_compile; cpu: the graph tour alone (default: neuron when a Neuron "
                        "device is present)")
    parser.add_argument("train_args", nargs="*", metavar="TRAIN_ARGS | COMMAND",
                        help="after --: the real run's arguments, or the command to precompile")


def _is_command(train_args: list[str]) -> bool:
    """`-- python my_train.py ...` (a command) rather than `-- --model ...` (our loop's flags)."""
    return bool(train_args) and not train_args[0].startswith("-")


def _resolve_cache(cli_dir: str | None, cfg: RunConfig | None) -> Path:
    in_args = cfg.compile.compile_cache if cfg is not None else None
    cache = store.open_cache(cli_dir or in_args or store.DEFAULT_CACHE_DIR)
    if cli_dir and in_args and Path(cli_dir).resolve() != Path(in_args).resolve():
        raise UsageError(f"--compile-cache {cli_dir} and --compile-cache {in_args} in TRAIN_ARGS "
                         "differ: the real run must use the cache precompile fills")
    return cache.absolute()


def _validate(args: argparse.Namespace) -> None:
    if args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.num_parallel is not None and args.num_parallel < 1:
        raise UsageError(f"--num-parallel must be >= 1, got {args.num_parallel}")
    if args.retries < 0:
        raise UsageError(f"--retries must be >= 0, got {args.retries}")
    if args.steps is not None and args.steps < 0:
        raise UsageError(f"--steps must be >= 0, got {args.steps}")


def _preflight(cache: Path, retry_failed: bool) -> None:
    """Refuse a damaged cache (the compiler would skip those graphs); warn about failed compiles."""
    cache.mkdir(parents=True, exist_ok=True)
    check_cache(cache, store.load_manifest(cache), retry_failed=retry_failed)


def _target(args: argparse.Namespace) -> str:
    from neuron_train.common.neuron_env import neuron_device_present

    return args.target if args.target != "auto" else ("neuron" if neuron_device_present() else "cpu")


def _loop_args(args: argparse.Namespace) -> list[str]:
    """TRAIN_ARGS, with --steps as the loop's own --precompile-steps."""
    if args.steps is None:
        return list(args.train_args)
    if any(a.split("=")[0] == "--precompile-steps" for a in args.train_args):
        raise UsageError("--steps and --precompile-steps in TRAIN_ARGS both set the tour's length: keep one")
    return [*args.train_args, "--precompile-steps", str(args.steps)]


def _main_script(args: argparse.Namespace) -> int:
    script = checked_command(args.train_args, _USAGE.splitlines()[1].strip())
    if args.nproc_per_node != 1:
        raise UsageError("--nproc-per-node is for neuron-train's own loop: a COMMAND starts its own processes "
                         "(e.g. `-- torchrun --standalone --nproc_per_node=W my_train.py`)")
    cache = _resolve_cache(args.compile_cache, None)
    plan = plan_script(script, cache=cache, target=_target(args), steps=args.steps, num_parallel=args.num_parallel,
                       retries=args.retries, retry_failed=args.retry_failed, env=os.environ)
    if not _announce(plan, args):
        return 0
    print(execute_script_plan(plan, script_device()), flush=True)
    return 0


def _announce(plan: TourPlan, args: argparse.Namespace) -> bool:
    """Print the plan (after a network file system warning); True when it should run now."""
    if message := network_fs_warning(plan.cache):
        warn(message)
    print(format_plan(plan), flush=True)
    if args.dry_run:
        return False
    _preflight(plan.cache, args.retry_failed)
    return True


def _loop_plan(cfg: RunConfig, train_args: list[str], cache: Path, args: argparse.Namespace) -> LoopPlan:
    """Our loop's plan: the tour and the real run get the cache (unless TRAIN_ARGS name it), the tour
    its length when it differs from --precompile-steps, the real run --require-precompiled."""
    extra = [] if cfg.compile.compile_cache else ["--compile-cache", str(cache)]
    steps = tour_steps(cfg)
    tour = [*extra, *([] if steps == cfg.train.precompile_steps else ["--precompile-steps", str(steps)])]
    real = [*extra, *([] if cfg.compile.require_precompiled else ["--require-precompiled"])]
    return plan_loop(train_args, tour_args=tour, real_args=real, cache=cache, target=_target(args),
                     world=args.nproc_per_node, num_parallel=args.num_parallel, retries=args.retries,
                     retry_failed=args.retry_failed, env=os.environ, run_id=uuid.uuid4().hex[:12])


def main(args: argparse.Namespace) -> int:
    _validate(args)
    if _is_command(args.train_args):
        return _main_script(args)
    train_args = _loop_args(args)
    cfg = config_from_train_args(train_args, prog="neuron-train precompile [options] --")
    cache = _resolve_cache(args.compile_cache, cfg)
    plan = _loop_plan(cfg, train_args, cache, args)
    if not _announce(plan, args):
        return 0
    text, summary = execute_loop_plan(plan)
    print(text, flush=True)
    if summary is not None and summary.failed:
        print(f"{summary.failed} graph(s) failed to compile and are cached as failed: fix the cause, "
              "then precompile again with --retry-failed", file=sys.stderr)
        return 1
    return 0
