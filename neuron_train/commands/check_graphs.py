"""`neuron-train check-graphs [options] -- COMMAND [ARGS...]`: is a PyTorch/XLA run graph-stable?

Runs COMMAND (any Python program using torch_xla: ours, a user's script, torchrun) with the
graph checker armed in each of its Python processes (a `sitecustomize` put first on PYTHONPATH),
then merges the processes' reports. Exit 0: graph-stable; 1: not (or the command failed); 2: usage.
With --compile-cache DIR it also compares every graph with what `neuron-train precompile -- COMMAND`
put into DIR (precompile/script_check.py), and --require-precompiled stops at the first one missing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from neuron_train.common.cli_parser import add_cache_option
from neuron_train.common.errors import UsageError
from neuron_train.common.fileio import new_output, write_failed, write_text_atomic
from neuron_train.common.writer import Target
from neuron_train.graphs.report import format_report
from neuron_train.instrument.marker import started
from neuron_train.instrument.runner import (
    DEFAULT_WARMUP,
    instrumented_env,
    load_records,
    merge_records,
    run_command,
)
from neuron_train.instrument.script import checked_command
from neuron_train.precompile.script_check import CoverageCheck

_USAGE = "neuron-train check-graphs [options] -- COMMAND [ARGS...]"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.usage = ("neuron-train check-graphs [--warmup-steps N] [--max-graphs K] [--json FILE] "
                    "[--compile-cache DIR [--require-precompiled]] -- COMMAND [ARGS...]")
    parser.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP, metavar="N",
                        help="also count every graph compiled in the first N steps as warm-up (default 0: "
                             "only the per-call-site rule: a site's graphs until it runs one again are its "
                             "warm-up). A step is a sync that ran a graph; in neuron-train's own loop, an "
                             "optimizer step")
    parser.add_argument("--max-graphs", type=int, default=None, metavar="K",
                        help="also fail when more than K distinct graphs are compiled")
    parser.add_argument("--json", metavar="FILE", help="write the full report as JSON (docs/graphs.md)")
    group = parser.add_argument_group("precompile coverage (of a cache `neuron-train precompile -- COMMAND` filled)")
    add_cache_option(group, help="compare every graph the command compiles with DIR's manifest: coverage, "
                     "and for each graph not precompiled its line and what differs from the precompiled "
                     "graph of the same line; the compiler uses DIR as its cache")
    group.add_argument("--require-precompiled", action="store_true", help="with --compile-cache: stop the "
                       "command at the first graph DIR does not hold, as its compile starts (exit 1)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to check, after --")


def main(args: argparse.Namespace) -> int:
    command = _command(args)
    json_path = _json_path(args.json)
    coverage = _coverage_check(args, command)
    with tempfile.TemporaryDirectory(prefix="neuron-train-check-graphs-") as folder:
        env = instrumented_env(Path(folder), args.warmup_steps)
        env.update(coverage.env(Path(folder)) if coverage else {})
        try:
            ended = run_command(command, env)  # SIGTERM/SIGINT end it early: the report is partial
        except OSError as exc:  # not executable, a directory, ...
            raise UsageError(f"cannot run {command[0]}: {exc.strerror or exc}") from None
        records = load_records(Path(folder))
        extra, passed = coverage.finish(Path(folder), records, ended.code) if coverage else ("", True)
        report = merge_records(records, command, ended, args.warmup_steps, args.max_graphs, started(Path(folder)))
    print("\n== neuron-train check-graphs ==", flush=True)
    print(format_report(report), flush=True)
    if extra:
        print(extra, flush=True)
    if json_path is not None:
        try:
            write_text_atomic(json_path, json.dumps(report.to_json(), indent=2, default=str))
        except OSError as exc:
            raise write_failed(json_path.path, exc) from None
    return 0 if report.stable and passed else 1


def _coverage_check(args: argparse.Namespace, command: list[str]) -> CoverageCheck | None:
    if args.require_precompiled and not args.compile_cache:
        raise UsageError("--require-precompiled needs --compile-cache DIR (the cache precompile filled)")
    if not args.compile_cache:
        return None
    return CoverageCheck(args.compile_cache, command, args.require_precompiled)


def _command(args: argparse.Namespace) -> list[str]:
    if args.warmup_steps < 0:
        raise UsageError("--warmup-steps must be >= 0")
    if args.max_graphs is not None and args.max_graphs < 1:
        raise UsageError("--max-graphs must be >= 1")
    return checked_command(list(args.command), _USAGE)


def _json_path(value: str | None) -> Target | None:
    """Checked before the run (a report never replaces an existing file; /proc, a read-only folder
    refused), and again when it is written (`write_text_atomic`)."""
    return None if value is None else new_output(value, "--json")
