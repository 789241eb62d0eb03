"""Parse torch_xla's PT_XLA_DEBUG "Compilation/Execution Analysis" blocks (torch_xla 2.9).

With `PT_XLA_DEBUG_LEVEL=1` torch_xla appends one block per compile to `PT_XLA_DEBUG_FILE`; with
level 2 also one block per graph execution. Format (torch_xla/csrc/debug_util.cpp, every line
carries the prefix "Compilation Analysis: " or "Execution Analysis: "):

    Compilation Analysis: ================================================================================
    Compilation Analysis: Compilation Cause
    Compilation Analysis:   user torch_xla.sync
    Compilation Analysis: Graph Info:
    Compilation Analysis:   Graph Hash: bf557fcbbc96fbdb1145248d32550c05
    Compilation Analysis:   Number of Graph Inputs: 5
    Compilation Analysis:   Number of Graph Outputs: 7
    Compilation Analysis: Python Frame Triggered Execution:
    Compilation Analysis:   sync (/.../site-packages/torch_xla/torch_xla.py:87)
    Compilation Analysis:   <module> (/tmp/train.py:13)
    Compilation Analysis: --------------------------------------------------------------------------------
    Compilation Analysis: ================================================================================

Frames are innermost first. The cause line is either a sync ("user torch_xla.sync", "torch_xla.sync
in parallel loader at step end", ...) or "most likely user code trying to access tensor value before
torch_xla.sync" (a host read, a CPU fallback or printing forced the pending graph to run).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

_PREFIXES = {"Compilation Analysis: ": "compile", "Execution Analysis: ": "execute",
             "Unexpected Execution Analysis: ": "execute"}
_RULE = "=" * 80
_FRAME = re.compile(r"^\s+(?P<func>.*) \((?P<file>.*):(?P<line>\d+)\)$")
_ACCESS_CAUSE = "access tensor value before"
_DYNAMO = f"{os.sep}_dynamo{os.sep}"


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class XlaEvent:
    """One compile or one execution of a graph, as torch_xla logged it."""

    kind: str                      # "compile" | "execute"
    offset: int = 0                # where the block starts in the parsed text
    cause: str = ""                # torch_xla's own words
    graph_hash: str = ""
    inputs: int = -1
    outputs: int = -1
    frames: list[Frame] = field(default_factory=list)

    @property
    def dynamo(self) -> bool:
        """Run by torch.compile's XLA bridge (its compiled graph, or the inputs it materialises)."""
        return "dynamo" in self.cause or any(_DYNAMO in f.file for f in self.frames)

    @property
    def host_access(self) -> bool:
        """True when user code read a tensor value (or a CPU fallback did) before the sync.

        torch_xla gives the same cause to the pending inputs torch.compile's XLA bridge runs before
        its own graph: those are part of how dynamo works, not a read by user code.
        """
        return _ACCESS_CAUSE in self.cause and not self.dynamo


def parse_debug_log(text: str) -> tuple[list[XlaEvent], int]:
    """Events of every complete block in `text`, and how many characters they span.

    A block still being written (no closing rule yet) is left for the next read: the returned
    length stops before it.
    """
    events: list[XlaEvent] = []
    consumed = 0
    pos = 0
    current: XlaEvent | None = None
    section = ""
    rules = 0
    for line in _lines(text):
        pos += len(line)
        body, kind = _strip_prefix(line.rstrip("\n"))
        if kind is None:
            if current is None:
                consumed = pos  # text between blocks (post-compilation analysis, blank lines)
            continue
        if body == _RULE:
            rules += 1
            if current is None:
                current, section, rules = XlaEvent(kind=kind, offset=pos - len(line)), "", 1
            elif rules == 2:
                events.append(current)
                current, consumed = None, pos
            continue
        if current is None:
            continue
        section = _section(body, section)
        _fill(current, body, section)
    return events, consumed


def _lines(text: str) -> list[str]:
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()  # an unfinished line: not ours yet
    return lines


def _strip_prefix(line: str) -> tuple[str, str | None]:
    for prefix, kind in _PREFIXES.items():
        if line.startswith(prefix):
            return line[len(prefix):], kind
    return line, None


def _section(body: str, section: str) -> str:
    if body.endswith("Cause"):
        return "cause"
    if body.startswith("Graph Info"):
        return "info"
    if body.startswith("Python Frame Triggered"):
        return "frames"
    return section


def _fill(event: XlaEvent, body: str, section: str) -> None:
    stripped = body.strip()
    if section == "cause" and body.startswith("  "):
        event.cause = stripped
    elif section == "info":
        key, _, value = stripped.partition(": ")
        if key == "Graph Hash":
            event.graph_hash = value
        elif key == "Number of Graph Inputs":
            event.inputs = int(value)
        elif key == "Number of Graph Outputs":
            event.outputs = int(value)
    elif section == "frames":
        match = _FRAME.match(body)
        if match:
            event.frames.append(Frame(match["func"], match["file"], int(match["line"])))


def user_frames(frames: list[Frame], is_internal: Callable[[str], bool]) -> list[Frame]:
    """The frames in user code (innermost first); all frames when none is user code."""
    mine = [f for f in frames if not is_internal(f.file)]
    return mine or frames


def library_namer(roots: tuple[str, ...], mechanism: tuple[str, ...]) -> Callable[[str], str]:
    """A function giving a third-party library file's package-relative path (`transformers/trainer.py`),
    or "" for any other file: user code, the standard library, and the `mechanism` packages (torch,
    torch_xla: every graph and read passes through them, so they name nothing)."""

    def name(path: str) -> str:
        for root in roots:
            if path.startswith(root):
                relative = path[len(root):].lstrip(os.sep)
                top = relative.split(os.sep, 1)[0]  # a package's folder, or a one-file module
                return "" if top.removesuffix(".py") in mechanism else relative
        return ""

    return name


def library_frame(frames: list[Frame], is_internal: Callable[[str], bool],
                  library_of: Callable[[str], str]) -> str:
    """`package/file.py:line` of the innermost third-party library frame inside the user's code
    (frames innermost first): the library line that ran the graph or read the value; "" if none."""
    for f in frames:
        if not is_internal(f.file):
            return ""
        name = library_of(f.file)
        if name:
            return f"{name}:{f.line}"
    return ""


_GENERATED = ("<frozen", "<eval_with_key>")  # the import system; torch.fx's generated code


def internal_file_predicate(internal: tuple[str, ...], keep: tuple[str, ...] = (),
                            always: tuple[str, ...] = ()) -> Callable[[str], bool]:
    """A test for files that are not the user's code.

    `always` (our instrumentation) is internal; then `keep` (code under test that may be installed
    among the libraries) is not; then anything under `internal` (libraries, the standard library)
    or not a real file is.
    """

    def is_internal(path: str) -> bool:
        if path.startswith(always):
            return True
        if keep and path.startswith(keep):
            return False
        return path.startswith(_GENERATED) or path.startswith(internal)

    return is_internal
