"""The graph checker's hooks into a process: step boundaries, host reads, optimizer scalars.

- `torch_xla.sync` (also behind `xm.mark_step`, `MpDeviceLoader`, `xm.optimizer_step`,
  `torch_xla.step()`) is wrapped: in a foreign script, a sync that ran a graph ends a step.
- Tensor methods that copy a value to the host (`.item()`, `bool()`, printing, `.tolist()`,
  `.cpu()`, ...) note the user's line when called on an XLA tensor. Reads inside step closures
  are the recommended pattern and are not noted; nested reads (printing calls `.item()`) count once.
- A global optimizer pre-step hook notes a hyperparameter that becomes, or stops being, 0 or 1:
  torch_xla bakes those two values into the graph, so such a change compiles a new graph.
- torch_xla's IR debug flag makes every graph op carry the Python line that created it (it does
  not change graph hashes). It costs tracing time, so the recorder keeps it on only during the
  warm-up and after a recompilation.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType

# Tensor method -> the kind of host read it is (records.HOST_READS).
_READS = {"item": "item", "tolist": "tolist", "__bool__": "bool", "__repr__": "print",
          "__format__": "print", "cpu": "cpu", "numpy": "numpy", "__float__": "float", "__int__": "int"}
_CLOSURE_FILES = (os.path.join("torch_xla", "utils", "closures.py"),)
_state = threading.local()


def install(recorder, count_syncs: bool = False) -> Callable[[], None]:
    """Hook `recorder` into this process; returns a function that removes the hooks."""
    import torch_xla

    undo: list[Callable[[], None]] = []
    previous = torch_xla._XLAC._get_ir_debug()
    torch_xla._XLAC._set_ir_debug(True)
    recorder.lines = True
    undo.append(lambda: torch_xla._XLAC._set_ir_debug(previous))
    undo += _wrap_reads(recorder)
    undo.append(_watch_optimizers(recorder))
    if count_syncs:
        undo += _wrap_sync(recorder)

    def remove() -> None:
        for step in reversed(undo):
            step()

    return remove


def caller_line(is_internal: Callable[[str], bool], frame: FrameType | None) -> str | None:
    """The innermost user line above `frame`; None inside a step closure (values are ready there)."""
    where = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.endswith(_CLOSURE_FILES) or frame.f_code.co_name == "_run_step_closures":
            return None
        if where is None and not is_internal(path):
            where = f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return where


def _wrap_reads(recorder) -> list[Callable[[], None]]:
    import torch

    undo = []
    for name, kind in _READS.items():
        own = torch.Tensor.__dict__.get(name)
        original = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, _read_wrapper(recorder, original, kind))
        undo.append(_restore(torch.Tensor, name, own))
    return undo


def _read_wrapper(recorder, original: Callable, kind: str) -> Callable:
    def read(self, *args, **kwargs):
        depth = getattr(_state, "depth", 0)
        if depth == 0 and self.device.type == "xla":
            where = caller_line(recorder.analyzer.is_internal, sys._getframe(1))
            if where:
                recorder.note_read(kind, where)
        _state.depth = depth + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _state.depth = depth

    read.__name__ = getattr(original, "__name__", kind)
    read.__doc__ = getattr(original, "__doc__", None)
    return read


def _restore(owner: type, name: str, own) -> Callable[[], None]:
    def restore() -> None:
        if own is None:
            delattr(owner, name)  # the method came from a base class: uncover it again
        else:
            setattr(owner, name, own)

    return restore


def _watch_optimizers(recorder) -> Callable[[], None]:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    special: dict[tuple, bool] = {}

    def before_step(optimizer, args, kwargs) -> None:
        for g, group in enumerate(optimizer.param_groups):
            for key, value in group.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                now = value in (0, 1)
                was = special.get((id(optimizer), g, key))
                special[(id(optimizer), g, key)] = now
                if was is not None and was != now:
                    where = caller_line(recorder.analyzer.is_internal, sys._getframe(1)) or ""
                    recorder.note_scalar({"group": g, "key": key, "value": value, "where": where})

    return register_optimizer_step_pre_hook(before_step).remove


def _wrap_sync(recorder) -> list[Callable[[], None]]:
    """In a foreign script every sync that ran a graph ends a step (unless our loop numbers them)."""
    import torch_xla

    module = sys.modules["torch_xla.torch_xla"]
    original = module.sync

    def sync(*args, **kwargs):
        if getattr(_state, "in_sync", False):
            return original(*args, **kwargs)
        before = recorder.log_size()
        _state.in_sync = True
        try:
            result = original(*args, **kwargs)
        finally:
            _state.in_sync = False
        ran_graph = recorder.log_size() > before or not recorder.files.log.exists()
        if ran_graph and not recorder.loop_steps:
            recorder.sync_steps += 1
            recorder.step_end(recorder.sync_steps)
        return result

    sync.__doc__ = original.__doc__
    module.sync = sync
    torch_xla.sync = sync

    def restore() -> None:
        module.sync = original
        torch_xla.sync = original

    return [restore]


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs `callback(module)` once `name` has been imported, whoever imports it first."""

    def __init__(self, name: str, callback: Callable):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def run(module) -> None:
            exec_module(module)
            try:
                self.callback(module)
            except Exception as exc:  # never break the user's program over the checker
                print(f"neuron-train check-graphs: instrumentation failed: {exc!r}", file=sys.stderr)

        spec.loader.exec_module = run
        return spec


