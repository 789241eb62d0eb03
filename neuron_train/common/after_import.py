"""Run code around a module's first import, whoever imports it and however (standard library only).

The start-up hook of check-graphs, precompile and bench (neuron_train/instrument/start.py) arms the
checker with this in every Python process: it must cost next to nothing in the many processes that
never import torch_xla, so this module imports only `importlib.util` and `sys`.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence

TYPE_CHECKING = False  # typing's flag without importing typing: these imports are for mypy only
if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from types import ModuleType


class AfterImport:
    """A `sys.meta_path` finder: `before()` runs just before `name` executes, `callback(module)` once it
    has been imported.

    Libraries often look before they import (transformers and accelerate call
    `importlib.util.find_spec("torch_xla")`, then import it later, lazily or through importlib):
    a look is not the import, so the finder stays in place and wraps the loader of every spec it
    hands out; the first wrapped loader that executes the module runs both and retires the finder.
    """

    def __init__(self, name: str, callback: Callable, before: Callable[[], None] | None = None):
        self.name, self.callback, self.before = name, callback, before
        self._looking = False
        self._done = False

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != self.name or self._looking or self._done:
            return None
        self._looking = True  # the search below walks sys.meta_path again, through this finder
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._looking = False
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def run(module: ModuleType) -> None:
            if self._done:
                exec_module(module)
                return
            self._done = True
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            if self.before is not None:
                _guarded(self.before)
            exec_module(module)
            _guarded(self.callback, module)

        # setattr: a deliberate patch of this loader's method, which mypy refuses as an assignment
        setattr(spec.loader, "exec_module", run)  # noqa: B010
        return spec


def _guarded(fn: Callable, *args: object) -> None:
    try:
        fn(*args)
    except Exception as exc:  # never break the user's program over the checker
        print(f"neuron-train check-graphs: instrumentation failed: {exc!r}", file=sys.stderr)
