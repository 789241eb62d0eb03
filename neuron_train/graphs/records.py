"""The typed records that cross the checker's modules (its causes and their fixes: graphs/causes.py).

A *window* is everything one process did between two step ends (log events, compiles the counters
saw, host reads, CPU fallbacks); the analyzer turns windows into `Graph` records. A report's JSON
keeps each graph's fields by name (`dataclasses.asdict`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from neuron_train.graphs import hlo_diff
from neuron_train.graphs.findings import DynamoEntry, FallbackOp, HostSync, ProcessSummary
from neuron_train.graphs.log import XlaEvent

T = TypeVar("T")

REPORT_FORMAT = "neuron-train/graph-report/v1"  # the merged report's "format" (check-graphs --json)
SCALAR_READ = "aten::_local_scalar_dense"  # a host read of one value, counted like a fallback op


@dataclass
class HostRead:
    kind: str        # a causes.ReadKind kind
    where: str       # the innermost user line
    phase: str
    library: str = ""  # the library line that read it (`transformers/masking_utils.py:369`), if any
    compiled: bool = False  # inside a torch.compile'd call: dynamo broke the step's graph there
    answer: bool | None = None  # what a bool() read answered (False from `padding_mask.all()`: padded)
    function: str = ""  # the library function that read it (`_ignore_causal_mask_sdpa`), if any


@dataclass
class LineReads:
    """A window's host reads at one line (graphs/hostsync.py `reads_by_line`): the hooks' reads and
    the log's host-access runs there."""

    kind: str            # a causes.ReadKind kind
    phase: str
    library: str = ""
    hooked: int = 0      # reads the hooks saw
    runs: int = 0        # graphs the log saw it run before the sync
    padded: bool = False  # a bool() read answered False (a padded batch's mask)
    compiled: bool = False  # inside a torch.compile'd call
    function: str = ""   # the library function that read (HostRead.function)


@dataclass
class ErrorNote:
    """A known error the run ended with (an uncaught exception the hooks matched to a cause's `error`)."""

    cause: str   # a causes.Cause name
    where: str   # the user's line that led to it; "" when none was seen


@dataclass
class ScalarChange:
    """An optimizer hyperparameter, or a module's (a dropout's p), that became, or stopped being,
    exactly 0 or 1 (graphs/hooks.py)."""

    group: int           # param_groups index (-1 for a module's)
    key: str             # its key there ("lr"), or the module's attribute ("p")
    value: float
    where: str           # the scheduler's line when one made it, else the optimizer step's; a module's: the write
    scheduler: str       # the scheduler's class name, "" without one
    module: str = ""     # the module's class when a module's attribute was written ("Dropout")


@dataclass
class LoaderOrigin:
    """Where a torch DataLoader was made: the line to fix when its batches change shape."""

    key: str                       # id of the loader in this process
    where: str                     # the user line that created it
    batch_size: int | None
    drop_last: bool
    samples: int | None            # len(dataset), when it has one
    collate: str = ""              # a custom collate_fn: "name (file:line)"; "" for torch's default
    collate_where: str = ""        # the collate_fn's `def` line
    library: str = ""              # the library line that made it (`transformers/trainer.py:1098`), if any
    grouped: bool = False          # its sampler groups samples by length (the Trainer's group_by_length=True)
    accumulation: int = 0          # the Trainer's gradient_accumulation_steps when a Trainer made it (> 1)
    logging_steps: int = 0         # the Trainer's logging_steps when a Trainer made it


@dataclass
class OptimizerStep:
    """An optimizer's n-th step() began (the first ones create its state: warm-up)."""

    n: int


@dataclass
class Batch:
    loader: str                    # LoaderOrigin.key
    shapes: list[str]              # each tensor in the batch as HLO names it: "f32[32,784]"


@dataclass
class Refused:
    """A host read that torch_xla refused to run (inside torch_xla.compile(full_graph=True))."""

    read: HostRead
    message: str


@dataclass
class DynamoNote:
    """What torch.compile's dynamo did (graphs/dynamo.py): recompiled a function, gave up on it, or
    broke a graph."""

    kind: str        # "recompile" | "limit" | "graph_break"
    function: str    # the function dynamo compiled: "step (torch/optim/sgd.py:105)"
    reason: str      # dynamo's own words: the failed guard, the limit, the graph break's reason
    where: str       # the user line running when it happened
    library: str = ""  # the library line below it, if any


@dataclass
class Window:
    """Everything that happened between two step ends (or after the last one): the log's events and the
    counters' deltas, and the records the hooks noted (`noted`, read by type with `of`: a new record the
    hooks note needs no field here, nor anything in the sink or the recorder)."""

    step: int | None                          # the step label; None: after the last step
    is_step: bool
    events: list[tuple[XlaEvent, str]]        # (event, phase)
    unlogged_compiles: int                    # compiles the counters saw and the log did not
    compile_times: list[float | None]         # seconds, per compile, log order
    hlo: dict[int, hlo_diff.HloSummary]       # index into events -> the compiled graph
    fallbacks: dict[str, int]                 # CPU fallback op -> new executions (counters)
    scalar_reads: int                         # new aten::_local_scalar_dense (counters)
    phase: str
    # what the hooks noted, in order: HostRead, Refused, ScalarChange, OptimizerStep, LoaderOrigin, Batch,
    # DynamoNote (each kind read with `of`)
    noted: list[object] = field(default_factory=list)
    eager: bool = False                       # torch_xla's eager mode was on (each op compiles and runs)
    compiled_at: str = ""                     # the user's line of the last torch.compile'd call (hooks)

    def of(self, kind: type[T]) -> list[T]:
        """The records of this kind the hooks noted in the window, in order."""
        return [note for note in self.noted if isinstance(note, kind)]

    @property
    def optimizer_steps(self) -> list[int]:
        """n for each optimizer's n-th step() in the window."""
        return [s.n for s in self.of(OptimizerStep)]


@dataclass
class Graph:
    """One distinct graph a process compiled (docs/graphs.md lists the fields of the JSON report)."""

    hash: str                      # torch_xla's graph hash (the compile-cache key); "" when unlogged
    phase: str                     # the phase label when it compiled ('main' in a foreign script)
    step: int | None               # the step it compiled in
    compile_time_s: float | None
    kind: str                      # "warmup" | "late" | "recompile"
    cause: str                     # one of the causes above
    detail: str                    # what changed (from the HLO diff), or why nothing is known
    where: str                     # the line to fix: file:line ("" when unknown)
    trigger: str                   # "sync" | "host access" | "dynamo" | ""
    site: list[str]                # the user frames that ran it, innermost first
    inputs: int                    # graph inputs and outputs (-1: unknown)
    outputs: int
    executions: int = 0            # how often it ran (filled in by the summary)
    library: str = ""              # the library line that ran it, or made the shape (package-relative)
    fix: str = ""                  # what to change (library-aware); causes.own_fix(cause) when ""
    after_steps: int = 0           # steps that had ended before its compile: a tour of one more reaches it


@dataclass
class CommandRun:
    """What check-graphs adds to the merged report about the command it ran."""

    command: list[str]
    exit_code: int
    killed_by: str | None
    interrupted_by: str | None
    command_tail: list[str]        # a failed command's last stderr lines
    max_graphs: int | None
    processes: list[ProcessSummary]


@dataclass
class GraphReport:
    """The checker's report: one process's (Analyzer/Recorder), or every process's merged
    (instrument/runner.py `merge_records`). JSON only at the edges: `to_json` when written,
    `from_json` when read back; the written shape is docs/graphs.md's."""

    warmup_steps: int
    steps: int
    graphs: list[Graph]
    host_syncs: list[HostSync]     # HostSyncs.report: one per line that read the device
    fallback_ops: dict[str, FallbackOp]  # CPU fallback op -> how often, from which step, where
    dynamo: list[DynamoEntry]      # dynamo's recompiles, limits, graph breaks (Analyzer._dynamo_notes)
    problems: list[str]
    compile_count: int = 0
    compile_time_s: float = 0.0
    source: str = ""               # one process's: "pt_xla_debug" | "counters"
    scalar_reads_after_warmup: int = 0
    pid: int | None = None         # one process's record (write_record): who wrote it
    argv: list[str] = field(default_factory=list)
    rank: str | None = None
    local_rank: str | None = None
    input_shapes: dict[str, list[str]] = field(default_factory=dict)  # graph hash -> its input shapes
    run: CommandRun | None = None  # the merged report: the command check-graphs ran
    errors: list[ErrorNote] = field(default_factory=list)  # known errors the run ended with (a problem each)

    @property
    def stable(self) -> bool:
        return not self.problems

    @property
    def late_graphs(self) -> list[Graph]:
        return [g for g in self.graphs if g.kind == "late"]

    @property
    def recompiles(self) -> list[Graph]:
        return [g for g in self.graphs if g.kind == "recompile"]

    def to_json(self) -> dict[str, Any]:
        graphs = [asdict(g) for g in self.graphs]
        late, recompiles = [asdict(g) for g in self.late_graphs], [asdict(g) for g in self.recompiles]
        host = [h.to_json() for h in self.host_syncs]
        fallback = {op: f.to_json() for op, f in self.fallback_ops.items()}
        dynamo = [d.to_json() for d in self.dynamo]
        verdict = {"problems": self.problems, "stable": self.stable}
        errors = {"errors": [asdict(e) for e in self.errors]} if self.errors else {}  # only when there are some
        if self.run is not None:
            r = self.run
            return {"format": REPORT_FORMAT, "command": r.command, "exit_code": r.exit_code,
                    "killed_by": r.killed_by, "interrupted_by": r.interrupted_by, "command_tail": r.command_tail,
                    "warmup_steps": self.warmup_steps, "max_graphs": r.max_graphs, "steps": self.steps,
                    "distinct_graphs": len(graphs), "compile_count": self.compile_count,
                    "compile_time_s": self.compile_time_s, "graphs": graphs, "late_graphs": late,
                    "recompiles": recompiles, "host_syncs": host, "fallback_ops": fallback, "dynamo": dynamo,
                    "processes": [p.to_json() for p in r.processes], **verdict, **errors}
        who = ({"pid": self.pid, "argv": self.argv, "rank": self.rank, "local_rank": self.local_rank}
               if self.pid is not None else {})
        return {**who, "warmup_steps": self.warmup_steps, "steps": self.steps, "distinct_graphs": len(graphs),
                "graphs": graphs, "late_graphs": late, "recompiles": recompiles, "host_syncs": host,
                "scalar_reads_after_warmup": self.scalar_reads_after_warmup, "fallback_ops": fallback,
                "dynamo": dynamo, "source": self.source, **verdict, "compile_count": self.compile_count,
                "compile_time_s": self.compile_time_s,
                **({"input_shapes": self.input_shapes} if self.pid is not None else {}), **errors}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GraphReport:
        """A report or a process's record as written by `to_json` (derived keys are recomputed)."""
        run = (CommandRun(data["command"], data["exit_code"], data.get("killed_by"), data.get("interrupted_by"),
                          data.get("command_tail", []), data.get("max_graphs"),
                          [ProcessSummary.from_json(p) for p in data.get("processes", [])])
               if "command" in data else None)
        return cls(warmup_steps=data["warmup_steps"], steps=data["steps"],
                   graphs=[Graph(**g) for g in data["graphs"]],
                   host_syncs=[HostSync.from_json(h) for h in data["host_syncs"]],
                   fallback_ops={op: FallbackOp.from_json(f) for op, f in data["fallback_ops"].items()},
                   dynamo=[DynamoEntry.from_json(d) for d in data.get("dynamo", [])], problems=data["problems"],
                   compile_count=data.get("compile_count", 0), compile_time_s=data.get("compile_time_s", 0.0),
                   source=data.get("source", ""), scalar_reads_after_warmup=data.get("scalar_reads_after_warmup", 0),
                   pid=data.get("pid"), argv=data.get("argv", []), rank=data.get("rank"),
                   local_rank=data.get("local_rank"), input_shapes=data.get("input_shapes", {}), run=run,
                   errors=[ErrorNote(**e) for e in data.get("errors", [])])
