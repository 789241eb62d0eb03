"""The graph checker's hooks into a process: step boundaries, host reads, optimizer scalars.

- `torch_xla.sync` (also behind `xm.mark_step`, `MpDeviceLoader`, `xm.optimizer_step`,
  `torch_xla.step()`): in a foreign script, a sync that ran a graph ends a step (syncs.py's one
  wrapper, which the probe of neuron_train.instrument subscribes to as well).
- Tensor methods that copy a value to the host (`.item()`, `bool()`, printing, `.tolist()`,
  `.cpu()`, ...) note the user's line when called on an XLA tensor. Reads inside step closures
  are the recommended pattern and are not noted; nested reads (printing calls `.item()`) count once.
- A global optimizer pre-step hook counts each optimizer's steps (the first ones create its state:
  warm-up) and notes a hyperparameter that becomes, or stops being, 0 or 1: torch_xla bakes those
  two values into the graph, so such a change compiles a new graph. LR schedulers are noted where
  they are made, so the report can name the schedule that set the value.
- A read that torch_xla refuses to run (inside `torch_xla.compile(full_graph=True)`) is noted, and
  check-graphs' processes print uncaught errors without the frames of these hooks: the user's
  traceback is their own.
- DataLoaders and their batches: loaders.py.
- torch_xla's IR debug flag makes every graph op carry the Python line that created it (it does
  not change graph hashes). It costs tracing time, so the recorder keeps it on only during the
  warm-up and after a recompilation.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from neuron_train.graphs import dynamo, loaders, syncs
from neuron_train.graphs.causes import INFERENCE_MODE, MARK_DYNAMIC, errors, tensor_reads
from neuron_train.graphs.frames import HERE, caller_line, in_dynamo, library_caller
from neuron_train.graphs.records import ErrorNote, OptimizerStep, ScalarChange
from neuron_train.graphs.sink import HookSink

__all__ = ["caller_line", "install"]

REFUSED = "Unexpected execution happens inside the compiled function"  # torch_xla.compile(full_graph=True)
_state = threading.local()


def install(recorder: HookSink, count_syncs: bool = False) -> Callable[[], None]:
    """Hook `recorder` into this process; returns a function that removes the hooks."""
    import torch_xla

    undo: list[Callable[[], None]] = []
    previous = torch_xla._XLAC._get_ir_debug()
    torch_xla._XLAC._set_ir_debug(True)
    recorder.lines = True
    undo.append(lambda: torch_xla._XLAC._set_ir_debug(previous))
    undo += _wrap_reads(recorder)
    schedulers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    undo.append(_watch_schedulers(recorder, schedulers))
    undo.append(_watch_optimizers(recorder, schedulers))
    undo += loaders.install(recorder)
    undo += dynamo.install(recorder)
    undo.append(_watch_eager_mode(recorder))
    undo.append(_watch_dropout(recorder))
    if count_syncs:
        undo.append(syncs.subscribe(_StepAtSync(recorder)))
        undo.append(_step_at_unsynced_optimizer_steps(recorder))
        undo.append(_count_compiled_calls(recorder))
        undo.append(_watch_inference_mode(recorder))
        undo.append(_watch_mark_dynamic(recorder))
        undo.append(_own_errors_only(recorder))

    def remove() -> None:
        for step in reversed(undo):
            step()

    return remove


def _wrap_reads(recorder: HookSink) -> list[Callable[[], None]]:
    import torch

    undo = []
    for name, kind in tensor_reads().items():
        own = torch.Tensor.__dict__.get(name)
        original = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, _read_wrapper(recorder, original, kind))
        undo.append(_restore(torch.Tensor, name, own))
    return undo


def _read_wrapper(recorder: HookSink, original: Callable[..., Any], kind: str) -> Callable[..., Any]:
    def read(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_state, "depth", 0)
        where, noted = None, None
        analyzer = recorder.analyzer
        if depth == 0 and self.device.type == "xla" and not in_dynamo(analyzer.is_internal, sys._getframe(1)):
            where = caller_line(analyzer.is_internal, sys._getframe(1))
            if where:
                library, function = library_caller(analyzer.is_internal, analyzer.library_of, sys._getframe(1))
                noted = recorder.note_read(kind, where, library, compiled=getattr(_state, "compiled_calls", 0) > 0)
                noted.function = function  # the library fix may depend on it (transformers' masking_utils)
        _state.depth = depth + 1
        try:
            result = original(self, *args, **kwargs)
            if noted is not None and kind == "bool":
                noted.answer = bool(result)  # False from transformers' `padding_mask.all()`: padded batches
            return result
        except RuntimeError as exc:
            if where and REFUSED in str(exc):
                recorder.note_refused(kind, where, str(exc).strip().splitlines()[0])
            raise
        finally:
            _state.depth = depth

    read.__name__ = getattr(original, "__name__", kind)
    read.__doc__ = getattr(original, "__doc__", None)
    return read


def _restore(owner: type, name: str, own: object) -> Callable[[], None]:
    def restore() -> None:
        if own is None:
            delattr(owner, name)  # the method came from a base class: uncover it again
        else:
            setattr(owner, name, own)

    return restore


def _watch_schedulers(recorder: HookSink, made: weakref.WeakKeyDictionary[Any, tuple[str, str]]) -> Callable[[], None]:
    """Note the line that made each LR scheduler, by optimizer (the last one made wins: a
    SequentialLR is made after the schedulers it chains)."""
    from torch.optim.lr_scheduler import LRScheduler

    original = LRScheduler.__init__

    def __init__(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        where = caller_line(recorder.analyzer.is_internal, sys._getframe(1)) or ""
        recorder.analyzer.scheduled = True
        original(self, optimizer, *args, **kwargs)
        try:
            made[optimizer] = (type(self).__name__, where)
        except TypeError:  # an optimizer that cannot be weakly referenced: no name in the report
            pass

    setattr(LRScheduler, "__init__", __init__)  # noqa: B010  (a deliberate method patch: mypy's method-assign)
    return lambda: setattr(LRScheduler, "__init__", original)


def _watch_optimizers(recorder: HookSink,
                      schedulers: weakref.WeakKeyDictionary[Any, tuple[str, str]]) -> Callable[[], None]:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    special: dict[tuple, bool] = {}
    steps: dict[int, int] = {}

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        steps[id(optimizer)] = steps.get(id(optimizer), 0) + 1
        if not recorder.analyzer.optimizer_where:  # where a sync goes when the loop has none
            recorder.analyzer.optimizer_where = caller_line(recorder.analyzer.is_internal, sys._getframe(1)) or ""
        recorder.note(OptimizerStep(steps[id(optimizer)]))
        for g, group in enumerate(optimizer.param_groups):
            for key, value in group.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                now = value in (0, 1)
                was = special.get((id(optimizer), g, key))
                special[(id(optimizer), g, key)] = now
                if was is not None and was != now:
                    where = caller_line(recorder.analyzer.is_internal, sys._getframe(1)) or ""
                    name, made_at = schedulers.get(optimizer, ("", ""))
                    recorder.note(ScalarChange(g, key, value, made_at or where, name))

    return register_optimizer_step_pre_hook(before_step).remove


def _watch_dropout(recorder: HookSink) -> Callable[[], None]:
    """Note a write of a dropout's `p` that reaches or leaves exactly 0 or 1 (a callback annealing it):
    torch drops the op at 0 and bakes the value in as a constant, so the step traces another graph. Only
    the dropout classes' attribute writes pass here (rare: set-up and such a callback)."""
    import torch
    from torch.nn.modules.dropout import _DropoutNd

    def __setattr__(self: Any, name: str, value: Any) -> None:
        old = self.__dict__.get(name) if name == "p" else None
        if isinstance(old, (int, float)) and isinstance(value, (int, float)) and (old in (0, 1)) != (value in (0, 1)):
            where = caller_line(recorder.analyzer.is_internal, sys._getframe(1)) or ""
            recorder.note(ScalarChange(-1, name, value, where, "", type(self).__name__))
        torch.nn.Module.__setattr__(self, name, value)

    setattr(_DropoutNd, "__setattr__", __setattr__)  # noqa: B010  (a deliberate method patch)
    return lambda: delattr(_DropoutNd, "__setattr__")


def _watch_eager_mode(recorder: HookSink) -> Callable[[], None]:
    """Note that torch_xla's eager mode was turned on (torch_xla.experimental.eager_mode(True)): its
    per-op compiles leave no PT_XLA_DEBUG record, so they have no hash. torch_xla.compile turns it off
    for the compiled call and back on afterwards, through the same switch."""
    import torch_xla

    xlac = torch_xla._XLAC
    original = xlac._set_use_eager_mode

    def _set_use_eager_mode(enable: bool) -> None:
        recorder.eager_mode = recorder.eager_mode or bool(enable)
        original(enable)

    xlac._set_use_eager_mode = _set_use_eager_mode
    return lambda: setattr(xlac, "_set_use_eager_mode", original)


class _StepAtSync:
    """In a foreign script every sync that ran a graph ends a step (unless our loop numbers them)."""

    def __init__(self, recorder: HookSink) -> None:
        self.recorder = recorder

    def before_sync(self) -> int:
        return self.recorder.log_size()

    def after_sync(self, before: int, caller: FrameType | None) -> None:
        self.recorder.syncs += 1
        if getattr(_state, "compiled_calls", 0):
            return  # a sync inside a torch.compile'd call: the call is the step (_count_compiled_calls)
        _end_step_if_ran(self.recorder, before)


def _end_step_if_ran(recorder: HookSink, log_size_before: int) -> None:
    # Only a sync that ran a graph is a step: MpDeviceLoader's first fetch, torch_xla.compile's
    # clearing of pending work and xm.rendezvous often sync with nothing pending.
    if recorder.log_size() > log_size_before and not recorder.loop_steps:
        recorder.sync_steps += 1
        recorder.step_end(recorder.sync_steps)


def _step_at_unsynced_optimizer_steps(recorder: HookSink) -> Callable[[], None]:
    """A loop that never syncs (timm's train.py on an XLA device) still repeats its optimizer step:
    an optimizer step with no sync since the one before ends a step, so what each step runs (a
    `loss.item()` that runs the whole pending graph) is judged step by step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    last = {"syncs": -1, "log": 0}

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if recorder.syncs == last["syncs"] and not recorder.loop_steps:
            _end_step_if_ran(recorder, last["log"])
        last.update(syncs=recorder.syncs, log=recorder.log_size())

    return register_optimizer_step_post_hook(after_step).remove


def _count_compiled_calls(recorder: HookSink) -> Callable[[], None]:
    """A call of a torch.compile'd function (the outermost one) that ran a graph ends a step too: the
    openxla backend syncs inside the call, so a compiled loop has no sync of its own to count.
    Dynamo runs each `_TorchDynamoContext.enter_exit_hooks` entry on entering a compiled call and
    the function it returns on leaving (torch/_dynamo/eval_frame.py)."""
    from torch._dynamo.eval_frame import OptimizeContext

    original = OptimizeContext.__init__

    def enter() -> Callable[[], None]:
        depth = getattr(_state, "compiled_calls", 0)
        _state.compiled_calls = depth + 1
        if depth == 0:
            recorder.compiled_at = caller_line(recorder.analyzer.is_internal, sys._getframe(1)) or ""
        before = recorder.log_size()

        def leave() -> None:
            _state.compiled_calls = depth
            recorder.syncs += 1  # the openxla backend synced inside the call
            if depth == 0:
                _end_step_if_ran(recorder, before)

        return leave

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.enter_exit_hooks.append(enter)

    setattr(OptimizeContext, "__init__", __init__)  # noqa: B010  (a deliberate method patch: mypy's method-assign)
    return lambda: setattr(OptimizeContext, "__init__", original)


def _watch_inference_mode(recorder: HookSink) -> Callable[[], None]:
    """Note the user's line that entered torch.inference_mode(): torch_xla cannot run every model
    under it (timm's validate(): `RuntimeError: Cannot set version_counter for inference tensor`)."""
    import torch

    cls = torch.inference_mode
    original = cls.__enter__

    def __enter__(self: Any) -> Any:
        if getattr(self, "mode", True) and not recorder.error_lines.get(INFERENCE_MODE):
            recorder.error_lines[INFERENCE_MODE] = caller_line(recorder.analyzer.is_internal, sys._getframe(1)) or ""
        return original(self)

    setattr(cls, "__enter__", __enter__)  # noqa: B010  (a deliberate method patch: mypy's method-assign)
    return lambda: setattr(cls, "__enter__", original)


def _watch_mark_dynamic(recorder: HookSink) -> Callable[[], None]:
    """Note the user's line that called torch._dynamo.mark_dynamic: on XLA a dimension it marks is
    specialized (one graph per size), and dynamo then refuses the mark (ConstraintViolationError)."""
    import torch._dynamo

    original = torch._dynamo.mark_dynamic

    def mark_dynamic(*args: Any, **kwargs: Any) -> Any:
        recorder.error_lines[MARK_DYNAMIC] = caller_line(recorder.analyzer.is_internal, sys._getframe(1)) or ""
        return original(*args, **kwargs)

    torch._dynamo.mark_dynamic = mark_dynamic
    return lambda: setattr(torch._dynamo, "mark_dynamic", original)


def _own_errors_only(recorder: HookSink) -> Callable[[], None]:
    """Print an uncaught error without the checker's frames (a host read hook sits between the
    user's line and torch_xla): the traceback the user sees is the one their program makes. An
    error whose cause is known is named with its fix in the process's record."""
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        recorder.analyzer.notes += [ErrorNote(cause.name, recorder.error_lines.get(cause.name, ""))
                                    for cause in errors() if cause.error in str(value)]
        previous(kind, value, _strip(value, tb))

    sys.excepthook = excepthook
    return lambda: setattr(sys, "excepthook", previous)


def _strip(value: BaseException | None, tb: TracebackType | None, depth: int = 0) -> TracebackType | None:
    kept = []
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(HERE):
            kept.append(tb)
        tb = tb.tb_next
    for a, b in zip(kept, kept[1:], strict=False):
        a.tb_next = b
    if kept:
        kept[-1].tb_next = None
    head = kept[0] if kept else None
    if value is not None and depth < 5:
        value.__traceback__ = head
        for chained in (value.__cause__, value.__context__):
            if chained is not None:
                _strip(chained, chained.__traceback__, depth + 1)
    return head
