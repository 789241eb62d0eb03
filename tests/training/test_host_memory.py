"""training/host_memory.py: freed memory stays mapped, so a step's buffers fault no pages again.

Each case runs in a process of its own (malloc's settings are the process's) and counts the page
faults of a second 48 MiB malloc/touch/free round, the size of XLA's CPU buffers that glibc would
otherwise mmap and unmap around every execution.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from neuron_train.training.host_memory import users_malloc_choice

PROBE = """
import ctypes, resource, sys
SETUP
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
SIZE = 48 << 20

def one_round():
    block = libc.malloc(SIZE)
    libc.memset(block, 1, SIZE)  # touch every page, as an execution writes its buffer
    libc.free(block)

one_round()  # the first round maps its pages in any case
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
one_round()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
KEEP = "from neuron_train.training.host_memory import keep_freed_memory; print(keep_freed_memory())"
BACKEND = ("from neuron_train.training.device import init_backend, prepare_environment; "
           "prepare_environment('fp32'); print(init_backend().kind == 'CPU')")
PAGES = (48 << 20) // 4096


def second_round_faults(setup: str, env: dict[str, str] | None = None) -> tuple[list[str], int]:
    import os

    run_env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")
               and not k.startswith("MALLOC_")}
    run_env.update(env or {})
    out = subprocess.run([sys.executable, "-c", PROBE.replace("SETUP", setup)], env=run_env, check=True,
                         capture_output=True, text=True, timeout=300).stdout.split()
    return out[:-1], int(out[-1])


@pytest.fixture(scope="module")
def default_faults() -> int:
    _, faults = second_round_faults("")
    if faults < PAGES // 2:
        pytest.skip(f"glibc's defaults fault only {faults} pages here (huge pages?): nothing to keep")
    return faults


def test_kept_memory_faults_no_page_again(default_faults: int) -> None:
    said, faults = second_round_faults(KEEP)
    assert said == ["True"]
    assert faults < default_faults // 10, (faults, default_faults)


def test_the_loop_keeps_freed_memory_on_the_cpu_device(default_faults: int) -> None:
    said, faults = second_round_faults(BACKEND, {"PJRT_DEVICE": "CPU"})
    assert said[-1] == "True"
    assert faults < default_faults // 10, (faults, default_faults)


@pytest.mark.parametrize("env", [{"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
                                 {"MALLOC_TRIM_THRESHOLD_": "131072"}])
def test_the_users_own_malloc_settings_are_kept(default_faults: int, env: dict[str, str]) -> None:
    said, faults = second_round_faults(KEEP, env)
    assert said == ["False"]
    assert faults > PAGES // 2


@pytest.mark.parametrize("env, chosen", [
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD"),
    ({"GLIBC_TUNABLES": "glibc.rtld.nns=2:glibc.malloc.arena_max=1"}, "GLIBC_TUNABLES"),
    ({"MALLOC_ARENA_MAX": "1"}, "MALLOC_ARENA_MAX"),
    ({"GLIBC_TUNABLES": "glibc.rtld.nns=2", "LD_PRELOAD": "libfoo.so", "PYTHONMALLOC": "malloc"}, None),
])
def test_users_malloc_choice(env: dict[str, str], chosen: str | None) -> None:
    assert users_malloc_choice(env) == chosen
