"""Real file-system faults for tests: a small tmpfs (a disk that really fills up) or a read-only
mount. Needs root and mount(8); otherwise the test is skipped with the reason."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(where: Path, size: str = "1m", read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `where` (created) for the block; unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("a real full or read-only file system needs a tmpfs mount, which needs root")
    if shutil.which("mount") is None:
        pytest.skip("mount(8) is not available")
    where.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(folder: Path, leave: int = 0) -> None:
    """Fill the file system of `folder` until at most `leave` bytes are free."""
    with open(folder / "filler", "wb") as fh:
        try:
            while shutil.disk_usage(folder).free > leave:
                fh.write(b"\0" * min(4096, max(1, shutil.disk_usage(folder).free - leave)))
                fh.flush()
        except OSError:
            pass
