"""glibc's malloc told to keep freed memory, for training on the CPU XLA device.

XLA's CPU runtime allocates each execution's buffers with malloc and frees them when it ends. By
default glibc serves a block above its mmap threshold (at most 32 MiB) with a fresh mmap and unmaps
it on free, and hands freed heap memory above 128 KiB back to the kernel: the next step's execution
then touches new pages, and the kernel maps and zeroes each one again. On ViT-Tiny/16 at 64 px,
batch 32 (a 45 MB buffer per backward) that was 10-17k page faults and 37-59 ms of kernel CPU per
~260 ms step, on the same 2 cores that run XLA's kernels; with mmap off and trimming off, 2-4k faults
and 15-19 ms (docs/measurements.md, issue 45). PyTorch's CPU guides get the same effect by preloading
jemalloc or tcmalloc. The cost: the process keeps its peak of freed memory until it exits.

A user who chose their own allocator or malloc settings (LD_PRELOAD, GLIBC_TUNABLES' glibc.malloc.*,
the MALLOC_*_ variables) keeps them: then nothing here changes.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
KEEP_FREED = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))  # no mmap'd blocks; no trimming (int max)


def users_malloc_choice(env: Mapping[str, str]) -> str | None:
    """The variable by which the user chose their own allocator or malloc settings, if any."""
    if "malloc" in env.get("LD_PRELOAD", ""):  # libjemalloc.so, libtcmalloc.so, libmimalloc.so
        return "LD_PRELOAD"
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return next((name for name in env if name.startswith("MALLOC_")), None)  # MALLOC_ARENA_MAX, ..._TRIM_THRESHOLD_


def keep_freed_memory(env: Mapping[str, str] = os.environ) -> bool:
    """Tell this process's glibc malloc to keep freed memory mapped (see the module's docstring).

    True when it did; False where the user chose their own settings or the C library is not glibc."""
    if users_malloc_choice(env) or not _glibc():
        return False
    libc = ctypes.CDLL(None)  # the process's own C library, already loaded
    return all(libc.mallopt(param, value) == 1 for param, value in KEEP_FREED)  # mallopt: 1 on success


def _glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):  # not a GNU C library
        return False
