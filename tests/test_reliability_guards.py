"""Issue 42 (reliability round 5), row 6 and item 7: guards that fresh mutants got past, and two
more one-line endings. A FIFO swapped in after the reader's first check, a file growing past its
bound while read, a read-only mount under `cache prune`, Ctrl-C while a command's module imports
torch, and the quiet torchrun rank's wait. In-process, or a plain Python child (no torch).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from test_reliability_cache import make_cache
from test_reliability_rules import age, compiled_entry

from neuron_train import cli
from neuron_train.common import reader
from neuron_train.common.errors import UsageError


def test_a_fifo_swapped_in_after_the_first_check_is_refused(tmp_path, monkeypatch):
    """Mutant: no `fstat` check after the open (the FIFO, opened O_NONBLOCK with no writer, was read
    as an empty file: a run silently used its defaults)."""
    path = tmp_path / "c.yaml"
    path.write_text("train: {}\n")
    first_check = reader.regular_file

    def swapped_after(p: str | os.PathLike, flag: str = "") -> os.stat_result:
        st = first_check(p, flag)
        Path(p).unlink()
        os.mkfifo(p)  # between the check and the open, as another process could
        return st

    monkeypatch.setattr(reader, "regular_file", swapped_after)
    with pytest.raises(UsageError, match="is a FIFO"):
        reader.read_bytes(path, "--config")


def test_a_file_growing_past_its_bound_while_read_is_refused(tmp_path, monkeypatch):
    """Mutant: the bound checked only on the size at the open (the rest was cut off silently)."""
    path = tmp_path / "prices.json"
    path.write_bytes(b"x" * 100)
    real_fstat = os.fstat

    def grows(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        with open(path, "ab") as fh:  # a writer appends after the size was taken
            fh.write(b"y" * 5000)
        return st

    monkeypatch.setattr(reader.os, "fstat", grows)
    with pytest.raises(UsageError, match="grew past 1,000 bytes while read"):
        reader.read_bytes(path, "--prices", limit=1000)


def test_prune_on_a_read_only_mount_is_one_line(tmp_path, capsys, monkeypatch):
    """Bad row 6: EROFS (the lock file cannot be created) was a traceback. The kernel's error is
    raised for every write into the cache, as a read-only mount would."""
    cache = make_cache(tmp_path / "c", compiled_entry())
    age(cache)
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if str(path).startswith(str(cache)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    code = cli.main(["cache", "prune", "--compile-cache", str(cache), "--older-than", "1d"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "is on a read-only file system" in err, err


def test_ctrl_c_while_a_commands_module_is_imported_is_one_line(capsys, monkeypatch):
    """Bad row 6: Ctrl-C while `train` imported torch was a 30-line traceback (the module was
    imported outside the handler)."""
    def interrupted(name: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert cli.main(["train", "--max-steps", "1"]) == 130
    assert capsys.readouterr().err == "neuron-train train: interrupted\n"


QUIET_RANK = """
import os, sys
os.environ["TORCHELASTIC_RUN_ID"] = "test"
from neuron_train.commands import train
print("waiting", flush=True)
train._wait_to_be_stopped()
print("returned", flush=True)
"""


def test_a_quiet_torchrun_rank_waits_until_it_is_stopped():
    """Mutant: the fixed 3 s sleep put back (rank 0 could be stopped by torchrun before it printed
    the one line). The rank must still be waiting well after 3 s, and end on torchrun's SIGTERM."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", QUIET_RANK], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline() == "waiting\n"
        time.sleep(5)
        assert child.poll() is None, "the quiet rank stopped waiting on its own"
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
