"""`neuron-train` console command: a thin dispatcher over one module per subcommand.

The modules live in neuron_train/commands/; a new command is one module there and one line in
COMMANDS below (docs/architecture.md). Each exposes `configure_parser(parser)` and `main(args) -> int`. Modules are
imported only for the subcommand that runs, so `neuron-train --help` does not pay for torch_xla.
A usage error is one line and exit 2 (`CommandParser`), as is a `UsageError`; a `RunError` is one
line and exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterator

from neuron_train.common.cli_parser import CommandParser
from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.fileio import unusable_path

# name -> (module, one-line help). The order is the order a user meets them.
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("neuron_train.commands.doctor", "check this machine: devices, Neuron SDK versions, cache, limits"),
    "precompile": ("neuron_train.commands.precompile", "precompile every graph of a run into the compile cache"),
    "train": ("neuron_train.commands.train", "train a model (the same as torchrun neuron_train/run.py)"),
    "check-graphs": ("neuron_train.commands.check_graphs", "find recompilations and host syncs in any XLA command"),
    "cache": ("neuron_train.commands.cache", "list / verify / prune / pack / unpack a compile cache"),
    "bench": ("neuron_train.commands.bench", "benchmark this machine and write one result file"),
    "report": ("neuron_train.commands.report", "merge benchmark results into a price-performance report"),
    "plan": ("neuron_train.commands.plan", "estimate every trn1/inf2 instance type from one CPU run (estimates)"),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="neuron-train",
        description="Train vision models on AWS Trainium/Inferentia2 via PyTorch/XLA "
        "(CPU XLA device when no Neuron device is present).",
        epilog="Run 'neuron-train COMMAND --help' for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """The parsed arguments, or the exit code when argparse ends the command: --help (0), or a
    usage error it has printed in one line (2)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return _exit_code(exc)


def _exit_code(exc: SystemExit) -> int:
    """The exit status `sys.exit(code)` would give (a message is printed, as Python would)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _capped(exc: Exception, limit: int = 600) -> str:
    """An error line of bounded length (a value from a crafted file can be megabytes long)."""
    text = " ".join(str(exc).split("\n"))
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _given_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(flag or argument name, value) for every string the command was given (or defaults to)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _given_paths(sub, args)
            continue
        values = getattr(args, action.dest, None)
        for value in values if isinstance(values, list) else [values]:
            if isinstance(value, (str, os.PathLike)) and os.fspath(value):
                yield (action.option_strings or [action.dest])[0], os.fspath(value)


def _path_error(exc: BaseException, parser: argparse.ArgumentParser, args: argparse.Namespace) -> UsageError | None:
    """`unusable_path`'s line, naming the option whose value (the longest one inside the failing
    path: a cache's manifest.json is in its --compile-cache) the path came from."""
    if unusable_path(exc) is None:
        return None
    failed = os.fsdecode(getattr(exc, "filename", None) or str(exc))
    matches = [(len(value), flag) for flag, value in _given_paths(parser, args)
               if value in failed or value.startswith(failed)]  # the path, or a folder of it, failed
    return unusable_path(exc, max(matches)[1] if matches else "")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = _top_parser()
        if not argv:
            parser.print_help()
            return 2
        code = _parse(parser, argv)  # help for -h, or one line naming the unknown command
        return code if isinstance(code, int) else 2
    name, rest = argv[0], argv[1:]
    try:
        return _run(name, rest)
    except KeyboardInterrupt:  # also while the command's module imports torch
        print(f"neuron-train {name}: interrupted", file=sys.stderr)
        return 130


def _run(name: str, rest: list[str]) -> int:
    """One command: its module imported, its options parsed, its errors one line."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = CommandParser(prog=f"neuron-train {name}", description=COMMANDS[name][1])
    module.configure_parser(parser)
    args = _parse(parser, rest)
    if isinstance(args, int):
        return args
    try:
        return int(module.main(args) or 0)
    except UsageError as exc:
        print(f"neuron-train {name}: error: {_capped(exc)}", file=sys.stderr)
        return 2
    except RunError as exc:
        print(f"neuron-train {name}: {_capped(exc)}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as exc:  # a path no command can use, wherever the command first touched it
        usage = _path_error(exc, parser, args)
        if usage is None:
            raise
        print(f"neuron-train {name}: error: {usage}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # e.g. a command's own parser (precompile's TRAIN_ARGS) printed its one line
        return _exit_code(exc)


if __name__ == "__main__":
    sys.exit(main())
