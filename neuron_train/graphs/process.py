"""Process set-up: point torch_xla's graph analysis and XLA's HLO dump at files the checker reads.

torch_xla reads PT_XLA_DEBUG_* at its first compile or execution and XLA reads XLA_FLAGS when the
device client starts: `prepare_process()` must run before either (neuron-train train and
check-graphs do). Set later, the watch still counts compiles, without hashes, causes or lines.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from neuron_train.common.neuron_env import default_pjrt_device
from neuron_train.graphs.log import internal_file_predicate, library_namer


def xla_counter(name: str) -> int:
    """A torch_xla counter (`UncachedCompile`, a fallback op's), 0 before it first counts."""
    import torch_xla

    return torch_xla._XLAC._xla_counter_value(name) or 0


def xla_metric(name: str) -> tuple[int, float]:
    """A torch_xla metric (`CompileTime`, `ExecuteTime`): how many samples, and their total in seconds."""
    import torch_xla

    data = torch_xla._XLAC._xla_metric_data(name)
    return (int(data[0]), float(data[1]) / 1e9) if data else (0, 0.0)


ENV_DIR = "NEURON_TRAIN_GRAPHS_DIR"          # set by check-graphs: every process writes here
ENV_WARMUP = "NEURON_TRAIN_GRAPHS_WARMUP"    # check-graphs --warmup-steps
ENV_XLA_FLAGS = "NEURON_TRAIN_GRAPHS_XLA_FLAGS"  # XLA_FLAGS as the user set them, before our dump
RECORD_PREFIX = "record."                    # <dir>/record.<pid>.json: one process's summary
PARTIAL_PREFIX = "partial."                   # <dir>/partial.<pid>.json: the same, during the run


@dataclass
class DebugFiles:
    log: Path                 # PT_XLA_DEBUG_FILE
    hlo_dir: Path | None      # XLA's --xla_dump_to, when ours
    start: int = 0            # log bytes that were there before us


_FILES: DebugFiles | None = None


def prepare_process(check: bool = True) -> DebugFiles:
    """Point torch_xla's graph analysis at files this process reads; call before any XLA work.

    `check=False` (the cheap mode every training run uses) logs compiles only; `check=True` also
    logs every graph execution (host reads before the sync) and dumps each new graph's HLO.
    """
    global _FILES
    if _FILES is not None:
        return _FILES
    shared = os.environ.get(ENV_DIR)
    if shared:
        base = Path(shared)
    else:
        base = Path(tempfile.mkdtemp(prefix="neuron-train-graphs-"))
        atexit.register(shutil.rmtree, base, True)
    pid = os.getpid()
    user_log = None if shared else os.environ.get("PT_XLA_DEBUG_FILE")
    log = Path(user_log) if user_log else base / f"xla-debug.{pid}.log"
    os.environ["PT_XLA_DEBUG_FILE"] = str(log)
    if shared or "PT_XLA_DEBUG_LEVEL" not in os.environ:
        os.environ["PT_XLA_DEBUG_LEVEL"] = "2" if check else "1"
    os.environ.setdefault("PT_XLA_DEBUG_MAX_FRAME", "100")  # torch.compile stacks are deep
    hlo_dir = None
    if check:
        flags = os.environ.setdefault(ENV_XLA_FLAGS, os.environ.get("XLA_FLAGS", ""))
        if "--xla_dump_to" not in flags:  # the user's own dump wins; we then skip the HLO diff
            hlo_dir = base / f"hlo.{pid}"
            os.environ["XLA_FLAGS"] = f"{flags} {dump_flags(hlo_dir, flags)}".strip()
    _FILES = DebugFiles(log, hlo_dir, log.stat().st_size if log.exists() else 0)
    return _FILES


CPU_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def dump_flags(hlo_dir: Path, flags: str, env: Mapping[str, str] | None = None) -> str:
    """XLA_FLAGS words for XLA's HLO dump into `hlo_dir`, given the user's `flags`.

    On the CPU device, XLA's default (MLIR fusion) kernel emitters make the dump write each fused
    kernel's MLIR, LLVM IR and object code besides the HLO the checker reads: 1,947 files for the HF
    Trainer fixture's 6 graphs, about 1.5 s of compile time; the classic emitters write 405 and
    compile faster. A flag changes every graph hash, though, unless torch_xla leaves it out: it hashes
    XLA_FLAGS into each graph's hash but skips the dump flags (runtime/env_hash.cc), and it splits the
    variable at spaces where XLA splits at any whitespace. Joined to the dump flag by a tab, the
    emitter flag is part of the dump flag to torch_xla (the hashes of a checked and an unchecked run
    stay equal: test_graphs.py) and a flag of its own to XLA. Left out when the user sets the emitters,
    and on other devices (only XLA's CPU backend has the flag).
    """
    dump = f"--xla_dump_to={hlo_dir}"
    if "xla_cpu_use_fusion_emitters" in flags or default_pjrt_device(env).upper() != "CPU":
        return dump
    return f"{dump}\t{CPU_EMITTERS}"


def internal_predicate() -> Callable[[str], bool]:
    """Files that are not the user's: libraries, the standard library, this instrumentation."""
    import torch
    import torch_xla

    paths = sysconfig.get_paths()
    libs = {paths["stdlib"], paths["purelib"], paths["platlib"],
            os.path.dirname(torch.__file__), os.path.dirname(torch_xla.__file__)}
    here = os.path.dirname(os.path.abspath(__file__))  # neuron_train/graphs: the instrumentation
    package = os.path.dirname(here)                    # the rest of neuron_train is user code
    return internal_file_predicate(tuple(sorted(libs)), keep=(package + os.sep,),
                                   always=(here + os.sep, *_ALSO_INTERNAL))


def also_internal(folder: str) -> None:
    """Files under `folder` are instrumentation too (the probe that runs next to the checker):
    never the user's line. Call before the first recorder is made."""
    _ALSO_INTERNAL.append(os.path.join(os.path.abspath(folder), ""))


def library_of() -> Callable[[str], str]:
    """Names a third-party library's file package-relative (`transformers/trainer.py`); "" otherwise."""
    paths = sysconfig.get_paths()
    roots = tuple(sorted({paths["purelib"] + os.sep, paths["platlib"] + os.sep}))
    return library_namer(roots, mechanism=("torch", "torch_xla", "functorch", "neuron_train",
                                                 "typing_extensions"))


_ALSO_INTERNAL: list[str] = []


@contextlib.contextmanager
def debug_env_kept() -> Iterator[None]:
    """torch_xla has read the debug variables by the end of the run: keep them from leaking into
    processes the test suite starts later."""
    names = ("PT_XLA_DEBUG_FILE", "PT_XLA_DEBUG_LEVEL", "PT_XLA_DEBUG_MAX_FRAME", "XLA_FLAGS", ENV_XLA_FLAGS)
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
