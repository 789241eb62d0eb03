"""The reader's refusals (common/reader.py), in-process: what is not a regular file (a FIFO, a device, a
directory), also when swapped in after the first check, and a file larger than its bound, also when it
grows while read: one line, at once. From the reliability reviews' rounds 4 and 5 (issue 31 bad row 8;
issue 42's mutants); each test was seen failing with its rule removed (docs/reliability.md).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from neuron_train.common import reader
from neuron_train.common.errors import UsageError


def special_files(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    return {"fifo": fifo, "device": Path("/dev/zero"), "directory": folder}

def test_the_reader_refuses_what_is_not_a_regular_file_without_blocking(tmp_path):
    """Bad row 8: a FIFO (no writer: an open or read would block for ever), a device (endless
    bytes), a directory: each one line, at once."""
    for kind, path in special_files(tmp_path).items():
        started = time.monotonic()
        with pytest.raises(reader.UsageError, match="not a regular file"):
            reader.read_bytes(path, "--config")
        assert time.monotonic() - started < 5, kind

def test_the_reader_refuses_a_file_larger_than_its_bound(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2000)
    with pytest.raises(reader.UsageError, match="2,000 bytes, more than any such file"):
        reader.read_bytes(big, "--prices", limit=1000)


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
