"""The checker's findings besides graphs, as typed records: host syncs, CPU fallback ops, dynamo's
notes, and a merged report's processes (docs/graphs.md lists their JSON fields).

Each is built and read as a record; `to_json` / `from_json` are the only places that know the
written keys (and their order, which the written JSON keeps byte for byte).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class HostSync:
    """One line that read a device value after warm-up (graphs/hostsync.py builds it)."""

    where: str
    kind: str                  # a causes.ReadKind kind
    what: str                  # how the report names the kind
    cause: str
    phase: str
    count: int = 0
    steps: list[int | None] = field(default_factory=list)   # the first steps it read in (at most 10)
    executes_graph: bool = False   # it ran part of the step as a graph of its own
    library: str = ""
    refused: str | None = None     # torch_xla refused to run it (full_graph=True): its message
    fix: str = ""
    every_step: bool = False       # in most steady steps: part of the step, not an occasional read
    logging_steps: int = 0         # the Trainer's loss log reads it, every that many optimizer steps (a
                                   # causes.Setting: the problem line and the fix name it); 0: not the log's

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.refused is None:
            del out["refused"]
        if not self.logging_steps:
            del out["logging_steps"]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostSync:
        return cls(**data)


@dataclass
class FallbackOp:
    """A CPU fallback op: how often it ran after warm-up, from which step, at which lines."""

    count: int
    first_step: int | None
    where: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FallbackOp:
        return cls(**data)


@dataclass
class DynamoEntry:
    """A dynamo note as reported (graphs/analyzer.py): the note's fields, then when, and the verdict."""

    kind: str          # "recompile" | "limit" | "graph_break"
    function: str      # the function dynamo compiled: "step (torch/optim/sgd.py:105)"
    reason: str
    where: str
    library: str
    step: int | None
    phase: str
    defect: bool
    count: int
    cause: str
    fix: str = ""
    detail: str | None = None  # the user's line that wrote the guarded value, when it is one
    graph: str | None = None   # the XLA graph this recompilation made, reported with that graph

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None or k not in ("detail", "graph")}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DynamoEntry:
        return cls(**data)


@dataclass
class ProcessSummary:
    """One process of a merged report: who it was and what it compiled."""

    pid: int | None
    rank: str | None
    local_rank: str | None
    argv: list[str]
    steps: int
    compile_count: int
    distinct_graphs: int
    source: str
    stable: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProcessSummary:
        return cls(**data)
