"""One wrapper over `torch_xla.sync` per process, that the checker and the probe subscribe to.

`torch_xla.sync` is where `xm.mark_step`, `MpDeviceLoader`, `xm.optimizer_step`, `torch_xla.step()`
and `torch_xla.compile` all end: it is the step boundary of any script. The checker (hooks.py)
counts a step there; the probe (neuron_train.instrument) times it and may stop the process there.
Each subscriber measures what it needs before the sync and acts after it, in the order they
subscribed (the checker first: its step is counted before the probe may stop the process).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol, TypeVar

_Token = TypeVar("_Token")


class SyncListener(Protocol[_Token]):
    def before_sync(self) -> _Token:
        """Called before the script's sync runs; the result is handed to `after_sync`."""

    def after_sync(self, before: _Token, caller: FrameType | None) -> None:
        """Called after it returned; `caller` is the frame that called sync."""


_listeners: list[SyncListener[Any]] = []
_original: list[Callable] = []   # torch_xla's own sync, while the wrapper is in place
_state = threading.local()


def subscribe(listener: SyncListener[Any]) -> Callable[[], None]:
    """Call `listener` around every outermost sync of this process; returns the unsubscribe."""
    if not _listeners:
        _install()
    _listeners.append(listener)

    def unsubscribe() -> None:
        if listener in _listeners:
            _listeners.remove(listener)
            if not _listeners:
                _uninstall()

    return unsubscribe


def _install() -> None:
    import torch_xla

    module = sys.modules["torch_xla.torch_xla"]
    original = module.sync

    def sync(*args: Any, **kwargs: Any) -> Any:
        # A sync inside a sync (a step closure that syncs) belongs to the outer one.
        if getattr(_state, "in_sync", False):
            return original(*args, **kwargs)
        listeners = list(_listeners)
        before = [listener.before_sync() for listener in listeners]
        _state.in_sync = True
        try:
            result = original(*args, **kwargs)
        finally:
            _state.in_sync = False
        caller = sys._getframe(1)
        for listener, token in zip(listeners, before, strict=True):
            listener.after_sync(token, caller)
        return result

    sync.__doc__ = original.__doc__
    _original.append(original)
    module.sync = sync  # type: ignore[attr-defined]  # monkeypatching torch_xla's sync
    torch_xla.sync = sync


def _uninstall() -> None:
    import torch_xla

    original = _original.pop()
    sys.modules["torch_xla.torch_xla"].sync = original  # type: ignore[attr-defined]  # undo the monkeypatch
    torch_xla.sync = original
