"""The recorder as the hooks see it (hooks.py, dynamo.py, loaders.py): what they read and note.

The recorder hands itself to the hooks and they never import it (or the analyzer) back; these
protocols say what they may use of it. `Recorder` and `Analyzer` match them (mypy checks where
`hooks.install(recorder)` is called).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from neuron_train.graphs.records import ErrorNote, Graph, HostRead


class AnalyzerView(Protocol):
    notes: list[ErrorNote]               # known errors the run ended with
    optimizer_where: str                 # the user's line of the first optimizer step
    scheduled: bool                      # an LR scheduler was made

    @property
    def is_internal(self) -> Callable[[str], bool]:
        """Not the user's file: a library, the standard library, the checker."""

    @property
    def library_of(self) -> Callable[[str], str]:
        """A library file named package-relative (`transformers/trainer.py`), else ""."""


class HookSink(Protocol):
    compiled_at: str         # the user's line of the last torch.compile'd call
    eager_mode: bool         # torch_xla's eager mode was ever on
    error_lines: dict[str, str]  # a cause with an `error` -> the user's line that leads to it (hooks.py)
    lines: bool              # trace ops with their Python line
    loop_steps: bool         # our loop numbers the steps
    sync_steps: int          # syncs that ran a graph
    syncs: int               # syncs and compiled calls

    @property
    def analyzer(self) -> AnalyzerView: ...

    def log_size(self) -> int: ...

    def step_end(self, step: int | None, is_step: bool = True) -> list[Graph]: ...

    def note_read(self, kind: str, where: str, library: str = "", compiled: bool = False) -> HostRead: ...

    def note_refused(self, kind: str, where: str, message: str) -> None: ...

    def note(self, record: object) -> None:
        """Anything else the hooks see, as a typed record (a ScalarChange, a DynamoNote, ...): the step's
        window holds it (`Window.of(kind)`)."""
