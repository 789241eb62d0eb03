"""The command table and the options every command shares: one name for the compile cache
(`--compile-cache DIR`), its older name `--cache-dir` kept working but hidden from --help; an
argument error is one line naming where the help is (issue 12)."""

from __future__ import annotations

import importlib

import pytest

from neuron_train import cli
from neuron_train.common.cli_parser import CommandParser
from neuron_train.training.config_io import config_from_args
from tests.precompile.test_reliability_cache import one_line, run


def parser_of(name: str) -> CommandParser:
    parser = CommandParser(prog=f"neuron-train {name}")
    importlib.import_module(cli.COMMANDS[name][0]).configure_parser(parser)
    return parser


# command -> (the words before the cache option, how the parsed value is read)
CACHE_USERS = {
    "train": ([], lambda args: config_from_args(args).compile.compile_cache),
    "check-graphs": ([], lambda args: args.compile_cache),
    "precompile": ([], lambda args: args.compile_cache),
    "cache": (["list"], lambda args: args.compile_cache),
    "doctor": ([], lambda args: args.compile_cache),
}


@pytest.mark.parametrize("name", sorted(CACHE_USERS))
@pytest.mark.parametrize("flag", ["--compile-cache", "--cache-dir"])
def test_every_command_takes_the_cache_under_both_names(name, flag, tmp_path):
    before, read = CACHE_USERS[name]
    args = parser_of(name).parse_args([*before, flag, str(tmp_path / "cc")])
    assert read(args) == str(tmp_path / "cc")


@pytest.mark.parametrize("name", sorted(CACHE_USERS))
def test_help_names_only_compile_cache(name, capsys):
    before = CACHE_USERS[name][0]
    with pytest.raises(SystemExit):
        parser_of(name).parse_args([*before, "--help"])
    out = capsys.readouterr().out
    assert "--compile-cache" in out and "--cache-dir" not in out


def test_every_command_module_is_in_commands():
    assert {module for module, _ in cli.COMMANDS.values()} == {
        f"neuron_train.commands.{name.replace('-', '_')}" for name in cli.COMMANDS}


def test_require_precompiled_without_a_cache_is_a_usage_error(capsys, tmp_path):
    assert cli.main(["check-graphs", "--require-precompiled", "--", "python", "-c", "pass"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["neuron-train check-graphs: error: --require-precompiled needs --compile-cache DIR "
                   "(the cache precompile filled)"]


def test_check_graphs_refuses_a_folder_that_precompile_did_not_fill(capsys, tmp_path):
    code = cli.main(["check-graphs", "--compile-cache", str(tmp_path), "--", "python", "-c", "pass"])
    err = capsys.readouterr().err
    assert code == 2 and "is not a precompiled cache" in err and "neuron-train precompile --compile-cache" in err


@pytest.mark.parametrize("argv, message, help_of", [
    (["cache", "prune", "--max-size"], "argument --max-size: expected one argument", "cache prune"),
    (["cache", "frobnicate"], "invalid choice: 'frobnicate'", "cache"),
    (["report", "x.json"], "the following arguments are required: --out", "report"),
    (["train", "--epochs", "x"], "argument --epochs: invalid int value: 'x'", "train"),
    (["bench", "--mode", "infer", "--output", "r.json", "--sweep-batch-sizes", "8,x"], "expected comma-separated",
     "bench"),
    (["precompile", "--", "--epochs", "x"], "argument --epochs: invalid int value: 'x'", "train"),
    (["frobnicate"], "invalid choice: 'frobnicate'", ""),
])
def test_argument_errors_are_one_line_with_where_the_help_is(capsys, argv, message, help_of):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in one_line(err) and "usage:" not in err and out == ""
    assert err.rstrip().endswith(f"(see `{' '.join(['neuron-train', *help_of.split()])} --help`)"), err

def test_help_still_prints_the_usage(capsys):
    code, out, _ = run(capsys, "cache", "prune", "--help")
    assert code == 0 and out.startswith("usage: neuron-train cache prune")
