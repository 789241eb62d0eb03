"""The argument parser of every `neuron-train` command: a usage error is one line, not a usage block.

argparse prints the whole usage (45 lines for `train`) before the line that matters. This parser
prints only that line and where the help is, and exits 2 like argparse.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, NoReturn


class CommandParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors read `PROG: error: MESSAGE (see `PROG --help`)`.

    Subcommand parsers made with `add_subparsers()` are of this class too (argparse's default).
    `help_command` names the help to point at when it is not this parser's own (e.g. the train
    options that `precompile` passes through).
    """

    def __init__(self, *args: Any, help_command: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help_command = help_command

    def error(self, message: str) -> NoReturn:
        see = self.help_command or f"{self.prog} --help"
        flag = re.fullmatch(r"argument (--[\w-]+)(?:/\S+)?: expected one argument", message)
        if flag:  # argparse reads a value like -1G as an option: say how to give it
            message += f" (a value that starts with '-' is written {flag[1]}=VALUE)"
        self.exit(2, f"{self.prog}: error: {message} (see `{see}`)\n")


def add_cache_option(parser: argparse._ActionsContainer, *, help: str, default: str | None = None) -> None:
    """`--compile-cache DIR`, the one name of the compile cache option in every command, and
    `--cache-dir DIR`, its older name, kept working but hidden from --help."""
    parser.add_argument("--compile-cache", dest="compile_cache", metavar="DIR", default=default, help=help)
    parser.add_argument("--cache-dir", dest="compile_cache", metavar="DIR", default=default,
                        help=argparse.SUPPRESS)
