"""torch.compile (dynamo) in a checked process: recompilations with dynamo's own reason, the fall-back
to eager at its recompile limit, and graph breaks (torch 2.9's torch/_dynamo, read from its source).

- `convert_frame.get_and_maybe_log_recompilation_reasons(cache_entry, frame)` runs when a compiled
  function's guards all failed and dynamo compiles it again; it returns the failed guards, e.g.
  `self.param_groups[0]['lr'] == 0.09000000000000001` (what `TORCH_LOGS=recompiles` prints).
- `convert_frame.exceeds_recompile_limit(cache_size, compile_id)` says when dynamo gives up
  (`torch._dynamo.config.recompile_limit`, 8): that function then runs eagerly, op by op, for the
  rest of the run.
- `symbolic_convert.log_graph_break(code_options, reason, ..., user_stack)` runs at each graph break.

Each is wrapped (results unchanged) and noted with the user's line that was running (the innermost
frame outside the libraries) and the library line of the function dynamo compiled.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from types import CodeType
from typing import Any

from neuron_train.graphs.frames import HERE, caller_line, library_line
from neuron_train.graphs.records import DynamoNote
from neuron_train.graphs.sink import HookSink


def install(recorder: HookSink) -> list[Callable[[], None]]:
    import torch._dynamo.convert_frame as convert_frame
    import torch._dynamo.symbolic_convert as symbolic_convert

    undo: list[Callable[[], None]] = []
    for module, name, wrap in ((convert_frame, "get_and_maybe_log_recompilation_reasons", _reasons),
                               (convert_frame, "exceeds_recompile_limit", _limit),
                               (symbolic_convert, "log_graph_break", _graph_break)):
        original = getattr(module, name)
        setattr(module, name, wrap(recorder, original))
        undo.append(functools.partial(setattr, module, name, original))
    return undo


def _function(recorder: HookSink, code: CodeType) -> str:
    """`step (torch/optim/sgd.py:105)`: the function dynamo compiles, its file package-relative."""
    library = recorder.analyzer.library_of(code.co_filename) or _torch_relative(code.co_filename)
    return f"{code.co_name} ({library or code.co_filename}:{code.co_firstlineno})"


def _torch_relative(path: str) -> str:
    for package in ("torch", "torch_xla"):
        marker = f"/site-packages/{package}/"
        if marker in path:
            return package + "/" + path.split(marker, 1)[1]
    return ""


def _first_line(reason: str) -> str:
    """`5/7: self.param_groups[0]['lr'] == 0.0478...` without dynamo's trailing source comment."""
    line = reason.strip().splitlines()[0] if reason.strip() else ""
    return line.split("  # ", 1)[0].strip()


# A guard on a plain Python number the compiled function was given (`5/1: scale == 2`,
# `L['step'] == 3`): the value comes from the user's call, which is the line to change.
_NUMBER_GUARD = re.compile(r"^\d+/\d+: (?:L\['(?!___)\w+'\]|(?!___)\w+) == -?[\d.]+(?:e[-+]?\d+)?$")


def _note(recorder: HookSink, kind: str, code: CodeType, reason: str) -> None:
    analyzer = recorder.analyzer
    frame = sys._getframe(2)
    where = caller_line(analyzer.is_internal, frame) or ""
    if kind == "recompile" and recorder.compiled_at and _NUMBER_GUARD.match(_first_line(reason)):
        where = recorder.compiled_at
    recorder.note(DynamoNote(kind, _function(recorder, code), _first_line(reason), where,
                                    library_line(analyzer.is_internal, analyzer.library_of, frame)))


def _reasons(recorder: HookSink, original: Callable[..., Any]) -> Callable[..., Any]:
    def get_and_maybe_log_recompilation_reasons(cache_entry: Any, frame: Any, *args: Any, **kwargs: Any) -> Any:
        reasons = original(cache_entry, frame, *args, **kwargs)
        if not (kwargs.get("skip_logging") or (args and args[0])):
            _note(recorder, "recompile", frame.f_code, reasons[0] if reasons else "no reason given by dynamo")
        return reasons

    return get_and_maybe_log_recompilation_reasons


def _limit(recorder: HookSink, original: Callable[..., Any]) -> Callable[..., Any]:
    def exceeds_recompile_limit(cache_size: Any, compile_id: Any, *args: Any, **kwargs: Any) -> Any:
        exceeded, limit_type = original(cache_size, compile_id, *args, **kwargs)
        if exceeded:
            import torch._dynamo.config as config

            code = sys._getframe(1).f_locals.get("code")
            reason = f"torch._dynamo.config.{limit_type} ({getattr(config, limit_type, '?')}) reached"
            if code is not None:
                _note(recorder, "limit", code, reason)
        return exceeded, limit_type

    return exceeds_recompile_limit


def _graph_break(recorder: HookSink, original: Callable[..., Any]) -> Callable[..., Any]:
    def log_graph_break(code_options: dict[str, Any], reason: object = "", *args: Any, **kwargs: Any) -> None:
        original(code_options, reason, *args, **kwargs)
        if str(code_options.get("co_filename", "")).startswith(HERE):
            return  # dynamo met the checker's read hook: the user's line breaks there too, noted as theirs
        stack = kwargs.get("user_stack") or (args[1] if len(args) > 1 else None) or []
        analyzer = recorder.analyzer
        mine = [f for f in reversed(stack) if not analyzer.is_internal(f.filename)]
        # a break inside a library function dynamo inlined: the user's line that called it, from the
        # real stack (the compiled user frame is running it)
        where = (f"{mine[0].filename}:{mine[0].lineno}" if mine
                 else caller_line(analyzer.is_internal, sys._getframe(1)) or "")
        library = next((f"{analyzer.library_of(f.filename)}:{f.lineno}" for f in reversed(stack)
                        if analyzer.library_of(f.filename)), "")
        function = f"{code_options.get('co_name', '?')} ({code_options.get('co_filename', '?')})"
        recorder.note(DynamoNote("graph_break", function, _first_line(str(reason)), where, library))

    return log_graph_break
