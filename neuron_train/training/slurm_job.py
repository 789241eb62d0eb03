"""What scripts/slurm_train.sbatch decides from a job's train flags, read as `train` reads them.

The batch script cannot read argparse's flags by their spelling: `--output-d DIR` and `--resum=FILE`
are `--output-dir` and `--resume` to `train` (unique prefixes), `--cache-dir` is `--compile-cache`,
and a `--config` file may name the run's directory. So the script asks this module, once, at
every start of the job:

    python3 -m neuron_train.training.slurm_job RESTART_COUNT [TRAIN_ARGS...]

It prints the flags to add (`--resume`, or nothing) and exits 0; a job it refuses is one line on
stderr and exit 2. A job Slurm requeues (its node was lost) runs the script again with the same
flags and restart count N > 0; it must find its run again, so every job names its output directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

from neuron_train.common.cli_parser import CommandParser
from neuron_train.common.errors import UsageError
from neuron_train.training.config_io import add_config_arguments, config_from_args

PROG = "slurm_train"


def flags_to_add(train_args: list[str], restarts: int) -> list[str]:
    """The flags this start of the job adds: `--resume` on a restart of a run that began (its output
    directory exists) unless the flags or the config already resume; a run whose node failed before
    it began (no directory yet) starts anew. Raises UsageError for a job that cannot be requeued."""
    parser = CommandParser(prog=PROG, add_help=False, help_command="neuron-train train --help")
    add_config_arguments(parser)
    args = parser.parse_args(train_args)  # a bad flag: argparse's one line, exit 2
    if "compile.compile_cache" in vars(args):
        raise UsageError("--compile-cache is set by this script (one local cache per host): use "
                         "NEURON_TRAIN_CACHE_DIR")
    cfg = config_from_args(args)
    if not cfg.train.output_dir:
        raise UsageError("name the run's directory with --output-dir (or train.output_dir in --config), on "
                         "storage all nodes share: a job Slurm requeues after a lost node continues the run "
                         "found there (the default, runs/<model>-<time>, differs at every start)")
    if restarts == 0 or cfg.checkpoint.resume or not Path(cfg.train.output_dir).exists():
        return []
    return ["--resume"]


def restart_count(text: str) -> int:
    """SLURM_RESTART_COUNT as a number (unset: 0)."""
    if not text:
        return 0
    if not text.isdigit():
        raise UsageError(f"SLURM_RESTART_COUNT must be a number of restarts, not {text!r}")
    return int(text)


def main(argv: list[str]) -> int:
    try:
        print(" ".join(flags_to_add(argv[1:], restart_count(argv[0] if argv else ""))))
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
