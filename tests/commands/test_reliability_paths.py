"""Issue 21, round 3: a path no command can use (too long, a name over 255 bytes, a symbolic link
loop, a file where a folder should be, permission denied) is one line and exit 2 for every path
option of every command, found where the command first touches it, before torch_xla starts.
In-process through `neuron_train.cli.main` on real paths; the one permission case runs as `nobody`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from neuron_train import cli
from tests.conftest import FAST, NANO, ROOT
from tests.precompile.test_reliability_cache import make_cache

RESULT = ROOT / "tests" / "fixtures" / "report" / "cpu_train_vit_digits.json"
NOOP = ["--", sys.executable, "-c", "pass"]  # a command that is never started when a path is refused


def _cases(tmp: Path, archive: Path, cache: Path) -> dict[str, tuple[str, list]]:
    """case -> (the flag the line must name, argv with P where the bad path goes)."""
    run, rep = tmp / "run", tmp / "rep"
    return {
        "train --output-dir": ("--output-dir", ["train", "--output-dir", "P", *NANO, *FAST]),
        "train --resume": ("--resume", ["train", "--output-dir", run, "--resume", "P", *NANO, *FAST]),
        "train --pretrained": ("--pretrained", ["train", "--output-dir", run, "--pretrained", "P", *NANO, *FAST]),
        "train --config": ("--config", ["train", "--output-dir", run, "--config", "P", *NANO, *FAST]),
        "check-graphs --json": ("--json", ["check-graphs", "--json", "P", *NOOP]),
        "check-graphs --compile-cache": ("--compile-cache", ["check-graphs", "--compile-cache", "P", *NOOP]),
        "precompile --compile-cache": ("--compile-cache", ["precompile", "--compile-cache", "P", *NOOP]),
        **{f"cache {sub}": ("--compile-cache", ["cache", sub, "--compile-cache", "P"])
           for sub in ("list", "verify")},
        "cache prune": ("--compile-cache", ["cache", "prune", "--compile-cache", "P", "--older-than", "0s"]),
        "cache pack --compile-cache": ("--compile-cache", ["cache", "pack", "--compile-cache", "P", tmp / "a.tar.gz"]),
        "cache pack ARCHIVE": ("cache pack FILE", ["cache", "pack", "--compile-cache", cache, "P"]),
        "cache unpack --compile-cache": ("--compile-cache", ["cache", "unpack", "--compile-cache", "P", archive]),
        "cache unpack ARCHIVE": ("archive", ["cache", "unpack", "--compile-cache", cache, "P"]),
        "bench --output": ("--output", ["bench", "--output", "P", *NOOP]),
        "report RESULT": ("", ["report", "P", "--out", rep]),
        "report --out": ("--out", ["report", RESULT, "--out", "P"]),
        "report --prices": ("--prices", ["report", RESULT, "--prices", "P", "--out", rep]),
        "report --reference": ("--reference", ["report", RESULT, "--reference", "P", "--out", rep]),
        "plan --output": ("--output", ["plan", "--output", "P", *NOOP]),
        "plan --calibrate": ("--calibrate", ["plan", "--calibrate", "P", *NOOP]),
        "doctor --compile-cache": ("--compile-cache", ["doctor", "--compile-cache", "P"]),
        "doctor --json": ("--json", ["doctor", "--json", "P"]),
    }


CASES = list(_cases(Path("t"), Path("a"), Path("c")))


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    """A real archive (packed by `cache pack`) and an empty cache, for the commands that need one."""
    tmp = tmp_path_factory.mktemp("packed")
    cache = make_cache(tmp / "cache", {"xla/1": b"graph"})
    assert cli.main(["cache", "pack", "--compile-cache", str(cache), str(tmp / "a.tar.gz")]) == 0
    return tmp / "a.tar.gz", make_cache(tmp / "empty", {})


def _bad_paths(tmp: Path) -> dict[str, str]:
    (tmp / "file").write_text("x")
    os.symlink(tmp / "loop2", tmp / "loop1")
    os.symlink(tmp / "loop1", tmp / "loop2")
    return {"too long": "a" * 100_000,  # ENAMETOOLONG for the path
            "a name over 255 bytes": str(tmp / ("b" * 256) / "x"),  # ENAMETOOLONG for one name
            "a symlink loop": str(tmp / "loop1" / "x"),  # ELOOP
            "under a file": str(tmp / "file" / "x")}  # ENOTDIR


@pytest.fixture(autouse=True)
def _clean_env(in_process_cli):
    """No launcher variables in the in-process CLI runs (conftest's in_process_cli)."""


@pytest.mark.parametrize("case", CASES)
def test_a_path_no_command_can_use_is_one_line_naming_the_option(case, tmp_path, capsys, packed):
    flag, argv = _cases(tmp_path, *packed)[case]
    had_xla = "torch_xla" in sys.modules
    for kind, bad in _bad_paths(tmp_path).items():
        code = cli.main([bad if a == "P" else str(a) for a in argv])
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and len(err) < 400, (kind, err[:2000])
        assert code == 2, (kind, err)
        if kind in ("too long", "a name over 255 bytes"):  # every command says it the same way
            assert "is too long (at most 4095 bytes, and 255 for each name in it): give a shorter path" in err
            assert f"error: {flag}: path '" in err or not flag, err
            assert "... (" in err or kind != "too long", err  # the value is cut
    assert had_xla or "torch_xla" not in sys.modules  # refused before torch_xla starts
    assert not (tmp_path / "run").exists() and not (tmp_path / "rep").exists()


def test_a_path_the_user_may_not_enter_is_one_line_naming_the_option(tmp_path, capsys):
    """EACCES needs a user that permissions apply to: the command runs as `nobody` (effective uid)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the command as another user")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    os.seteuid(65534)
    try:
        code = cli.main(["cache", "list", "--compile-cache", str(locked / "cc")])
    finally:
        os.seteuid(0)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("neuron-train cache: error: --compile-cache: path '/")
    assert err.endswith(" cannot be used: permission denied: fix its permissions or choose another location\n")
