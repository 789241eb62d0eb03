"""Which Python line a hook was called from: the innermost frame in the user's code."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import FrameType

_CLOSURE_FILES = (os.path.join("torch_xla", "utils", "closures.py"),)
CLOSURE_FUNCTION = "_run_step_closures"  # torch_xla.core.xla_model: runs xm.add_step_closure(...)
HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the checker's own files


def caller_line(is_internal: Callable[[str], bool], frame: FrameType | None) -> str | None:
    """The innermost user line above `frame`; None inside a step closure (values are ready there)."""
    where = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.endswith(_CLOSURE_FILES) or frame.f_code.co_name == CLOSURE_FUNCTION:
            return None
        if where is None and not is_internal(path):
            where = f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return where


_DYNAMO = os.path.join("torch", "_dynamo") + os.sep


def in_dynamo(is_internal: Callable[[str], bool], frame: FrameType | None) -> bool:
    """Called by torch.compile's dynamo itself (its tracing, guards, error messages): not the user's
    read. Only frames below the innermost user frame count: a compiled call's own frames (dynamo's
    `_fn` wrapper in eval_frame.py) sit above the user's function, whose reads run eagerly at a graph
    break and are the user's."""
    while frame is not None:
        path = frame.f_code.co_filename
        if _DYNAMO in path:
            return True
        if not is_internal(path) and not path.startswith("<"):  # `<string>`: code dynamo generated (guards)
            return False
        frame = frame.f_back
    return False


def library_caller(is_internal: Callable[[str], bool], library_of: Callable[[str], str],
                   frame: FrameType | None) -> tuple[str, str]:
    """(`package/file.py:line`, its function) of the innermost third-party library frame below the
    user's line; ("", "") if none."""
    while frame is not None:
        path = frame.f_code.co_filename
        if not is_internal(path):
            return "", ""
        name = library_of(path)
        if name:
            return f"{name}:{frame.f_lineno}", frame.f_code.co_name
        frame = frame.f_back
    return "", ""


def library_line(is_internal: Callable[[str], bool], library_of: Callable[[str], str],
                 frame: FrameType | None) -> str:
    """`package/file.py:line` of the innermost third-party library frame below the user's line."""
    return library_caller(is_internal, library_of, frame)[0]


def code_line(fn: object) -> str:
    """`file:line` of a function's `def` (functools.partial and callable objects included)."""
    fn = getattr(fn, "func", fn)
    code = getattr(fn, "__code__", None) or getattr(type(fn).__dict__.get("__call__"), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""
