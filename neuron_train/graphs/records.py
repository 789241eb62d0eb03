"""The checker's vocabulary: causes, their fixes, and the typed records that cross its modules.

A *window* is everything one process did between two step ends (log events, compiles the counters
saw, host reads, CPU fallbacks); the analyzer turns windows into `Graph` records. A report's JSON
keeps each graph's fields by name (`dataclasses.asdict`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from neuron_train.graphs import hlo_diff
from neuron_train.graphs.findings import DynamoEntry, FallbackOp, HostSync, ProcessSummary
from neuron_train.graphs.log import XlaEvent

REPORT_FORMAT = "neuron-train/graph-report/v1"  # the merged report's "format" (check-graphs --json)
WARMUP = "warm-up"
NEW_CALL_SITE = "new call site"
HOST_ACCESS = "host access before sync"
VALUE_BRANCH = "value-dependent control flow"
DATA_DEPENDENT = "data-dependent shape"
HOST_READ = "host read after the sync"       # a copy that waits for the device; no extra graph
COMPILED_READ = "host access inside torch.compile"  # a read in a compiled call: a graph break, a wait mid-step
NEW_INPUT_SHAPE = hlo_diff.NEW_INPUT_SHAPE
NEW_CONSTANT = hlo_diff.NEW_CONSTANT
GRAPH_STRUCTURE = hlo_diff.GRAPH_STRUCTURE
SLICE_OFFSET = hlo_diff.SLICE_OFFSET
UNKNOWN = hlo_diff.UNKNOWN
DYNAMO_RECOMPILE = "dynamo recompilation"    # a guard of a torch.compile'd function failed
DYNAMO_EAGER = "dynamo fell back to eager"   # recompile limit reached: the function runs op by op
GRAPH_BREAK = "graph break"                  # torch.compile split a function (reported, not a defect)
PYTHON_BRANCH = "Python branch"              # a Python `if` chose which ops a step traced
SLICE_SHAPE = "slice-made shape"             # a slice with a computed length made an input's shape
GROWING_CONCAT = "tensor grown by concatenation"  # torch.cat onto the last run's result: a new length each run
GROWING_GRAPH = "graph grows every step"     # no sync ends the step: each graph holds every step before it
FSDP_AFTER_EVAL = "one-time graph after evaluation"  # torch_xla FSDP: parameters an evaluation left gathered
ACCUMULATION_REMAINDER = "gradient-accumulation remainder"  # an epoch's last window has fewer micro-batches

FIXES = {
    NEW_CALL_SITE: "precompile must run this code path too (e.g. an evaluation in the precompile run)",
    HOST_ACCESS: "read values after the step's sync, in xm.add_step_closure(...)",
    VALUE_BRANCH: "compute both branches and pick with torch.where instead of a Python `if` on a tensor",
    DATA_DEPENDENT: "keep shapes static: mask (torch.where, multiply by a 0/1 mask) instead of "
                    "nonzero() or boolean indexing",
    NEW_INPUT_SHAPE: "give every batch the same shape: drop_last=True, or pad/bucket to fixed sizes",
    NEW_CONSTANT: "avoid the exact values 0 and 1 for Python scalars that change (start a warm-up "
                  "above 0, or pass the value as a device tensor)",
    GRAPH_STRUCTURE: "make slice and loop lengths fixed (pad to the maximum length and mask)",
    HOST_READ: "fine once in a while; in every step, move it into xm.add_step_closure(...)",
    COMPILED_READ: "return the tensor from the compiled function and read it after the call's sync "
                   "(torch_xla.sync(), or in xm.add_step_closure(...)): inside the compiled step the read "
                   "breaks its graph in two and waits for the device mid-step",
    UNKNOWN: "no difference the checker reads (input shapes, constants, ops, slice bounds) tells the two graphs "
             "apart: torch_xla's hash also covers what the HLO text leaves out (input layouts and shardings, "
             "donated buffers); diff the two graphs' HLO (XLA_FLAGS=--xla_dump_to=DIR, "
             "*.before_optimizations.txt of the two hashes) and keep whatever differs the same every step",
    FSDP_AFTER_EVAL: "nothing to change in the script: one more training graph, compiled once and run again after "
                     "every evaluation; precompile covers it when its tour runs a training step after the first "
                     "evaluation: a DataLoader-fed loop's default tour does (past the first epoch's end), else "
                     "raise --steps past the first evaluation (precompile names the --steps that reach it)",
    SLICE_OFFSET: "slice on the host: keep the data on the CPU and move each batch to the device "
                  "(`source[i:i + n].to(device)`): one graph for every offset; a slice of a device tensor "
                  "at a Python offset bakes the offset into the step's graph",
    DYNAMO_RECOMPILE: "keep what the failed guard checks constant: pass a changing Python number as a "
                      "tensor (e.g. the optimizer's lr=torch.tensor(0.01)), give every batch one shape",
    DYNAMO_EAGER: "remove the recompilations above; raising torch._dynamo.config.recompile_limit only "
                  "compiles more graphs",
    PYTHON_BRANCH: "make the choice on the device (torch.where, or multiply by a 0/1 mask) so one graph "
                   "serves every path, or keep the branch out of the traced step (sync before it; for an "
                   "accumulation remainder, sync every micro-batch or give every window the same length)",
    SLICE_SHAPE: "cut to a few fixed lengths (buckets, each compiled once and precompiled) or pad to one "
                 "fixed length and mask the padding",
    GROWING_CONCAT: "collect per-step results without growing a device tensor: append each one to a "
                    "Python list and torch.cat once after the loop, or move each to the CPU after the step's "
                    "sync (in xm.add_step_closure)",
    GROWING_GRAPH: "end every step with a sync: torch_xla.sync() (or xm.mark_step()) right after the "
                   "optimizer step, or iterate the loader through torch_xla's MpDeviceLoader, which syncs at "
                   "each step's end",
    ACCUMULATION_REMAINDER: "make the batches per epoch a multiple of gradient_accumulation_steps (the dataset's "
                            "size, the batch size or gradient_accumulation_steps), or accept the one extra "
                            "step graph (compiled once, run every epoch) and precompile it",
    GRAPH_BREAK: "fine when it is outside the step's hot path; torch._dynamo.explain(fn)(*args) lists them",
}

# CPU fallback ops whose result has a data-dependent length, and the fixed-length way to the same values.
FALLBACK_FIXES = {
    "aten::_unique2":
        "count with a fixed length: torch.nn.functional.one_hot(labels, num_classes).sum(0) counts every class "
        "(0 for one a batch lacks), where torch.unique(..., return_counts=True) returns only the classes present, "
        "a length that depends on the data (and runs on the CPU)",
}

HOST_MIXUP = ("timm's Mixup/CutMix on device tensors draws a new box (and mixing factor) every batch, so every "
              "batch is a new graph: apply Mixup/CutMix on the host, in the data loader (the DataLoader's "
              "collate_fn, e.g. timm's FastCollateMixup), or `neuron-train train --mixup/--cutmix`, which "
              "mixes on the host; the device then gets one batch shape and soft targets as data")

EAGER = ("load the model with attn_implementation=\"eager\" (from_pretrained(..., attn_implementation=\"eager\"), "
         "or the config's), whose mask is built without reading it")


@dataclass(frozen=True)
class LibraryFix:
    """A fix the user can apply from their own code for a finding at a library line (the library line
    alone is not actionable). Each entry is applied to a registry-package fixture and shown to remove
    its finding (tests/test_library_fixes.py); the first matching entry wins."""

    library: str                 # package-relative file, or a folder ending in "/"
    cause: str
    fix: str
    function: str = ""           # only for a read in this library function ("": any)
    padded: bool | None = None   # only when a bool() read answered False (True) or never did (False)

    def matches(self, cause: str, library: str, padded: bool, function: str) -> bool:
        return (cause == self.cause and library.startswith(self.library)
                and self.function in ("", function) and self.padded in (None, padded))


LIBRARY_FIXES = (
    # transformers 5.24 asks `padding_mask.all()` (an encoder's bidirectional mask) or whether the padding
    # mask is all ones (a causal model's, with sdpa), and without a mask checks a causal model's position
    # ids for packed sequences: which change removes the read depends on the function that read.
    LibraryFix("transformers/masking_utils.py", VALUE_BRANCH, function="_ignore_bidirectional_mask_sdpa",
               padded=False, fix="transformers asks `padding_mask.all()` in every forward to skip the mask when "
               "nothing is padded; with fixed-length, unpadded batches leave `attention_mask` out of the batch "
               "(your dataset or collator): the model then builds no mask and reads nothing"),
    # Padded batches (the read answered False): a 4D bool mask gives BERT's sdpa the same outputs, no read.
    LibraryFix("transformers/masking_utils.py", VALUE_BRANCH, function="_ignore_bidirectional_mask_sdpa",
               padded=True, fix="transformers asks `padding_mask.all()` in every forward to skip the mask when "
               "nothing is padded; these batches are padded (the mask it read has zeros), so keep `attention_mask` "
               "(leaving it out would attend to the padding): hand the model a prepared 4D mask, which "
               "masking_utils uses as is without reading it (attention_mask[:, None, None, :].bool() for the sdpa "
               "attention), in your collator or before the forward"),
    LibraryFix("transformers/masking_utils.py", VALUE_BRANCH, function="_ignore_causal_mask_sdpa",
               fix="transformers asks whether the padding mask is all ones in every forward of a causal model with "
               "sdpa attention (to let sdpa apply causality without a mask): keep `attention_mask` and " + EAGER
               + "; leaving `attention_mask` out only moves the read (to a check of the position ids for packed "
               "sequences)"),
    LibraryFix("transformers/masking_utils.py", VALUE_BRANCH, function="find_packed_sequence_indices",
               fix="without an `attention_mask` transformers checks a causal model's position ids for packed "
               "sequences in every forward: pass `attention_mask` (all ones when nothing is padded) and " + EAGER
               + " (with sdpa attention the mask itself is read instead)"),
    LibraryFix("transformers/trainer.py", NEW_INPUT_SHAPE,
               "TrainingArguments(dataloader_drop_last=True) for a ragged last batch; for varying lengths pad every "
               "batch to one length (a collator with padding=\"max_length\", or pad_to_multiple_of for a few "
               "buckets)"),
    LibraryFix("transformers/trainer_pt_utils.py", GROWING_CONCAT,
               "the Trainer's evaluation loop concatenates every eval batch's losses, logits and labels onto the "
               "last ones on the device (a new length, so a new graph, per batch): TrainingArguments("
               "eval_accumulation_steps=1) moves each batch's results to the CPU after its step and concatenates "
               "there; prediction_loss_only=True does not help (the losses are still concatenated)"),
    LibraryFix("transformers/data/data_collator.py", NEW_INPUT_SHAPE,
               "the collator pads each batch to its own longest sample (dynamic padding: a new length, so a new "
               "graph, per batch): DataCollatorWithPadding(tokenizer, padding=\"max_length\", max_length=N) for one "
               "length, or pad_to_multiple_of=M for a few (each compiled once: precompile them)"),
    LibraryFix("accelerate/", NEW_INPUT_SHAPE,
               "drop_last=True on the DataLoader you hand to accelerator.prepare (accelerate keeps it), or "
               "pad/bucket to fixed sizes"),
    LibraryFix("timm/data/mixup.py", SLICE_SHAPE, HOST_MIXUP),
    LibraryFix("torch/optim/", DYNAMO_RECOMPILE,
               "dynamo guards on the optimizer's Python hyperparameters: a scheduler that changes a float LR "
               "recompiles the optimizer step every step; create the optimizer with lr=torch.tensor(LR) "
               "(the scheduler then updates the tensor in place)"),
)


def fix_for(cause: str, library: str, padded: bool = False, function: str = "") -> str:
    """The fix for a finding: the library-aware one when the library line matches a known pattern
    (`padded`: the library's bool() read answered False; `function`: the library function that read)."""
    known = next((entry for entry in LIBRARY_FIXES if entry.matches(cause, library, padded, function)), None)
    return known.fix if known is not None else FIXES.get(cause, FIXES[UNKNOWN])


# Host reads recorded by the hooks: kind -> how the report names it.
HOST_READS = {"item": ".item()", "bool": "Python if/bool() on a tensor", "print": "printing a tensor",
              "tolist": ".tolist()", "cpu": ".cpu()", "numpy": ".numpy()", "float": "float()",
              "int": "int()", "value": "a tensor value read", "fallback": "a CPU fallback op"}
READ_CAUSES = {"bool": VALUE_BRANCH, "fallback": DATA_DEPENDENT}
SCALAR_READ = "aten::_local_scalar_dense"  # a host read of one value, counted like a fallback op


@dataclass
class HostRead:
    kind: str        # a HOST_READS key
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

    kind: str            # a HOST_READS key
    phase: str
    library: str = ""
    hooked: int = 0      # reads the hooks saw
    runs: int = 0        # graphs the log saw it run before the sync
    padded: bool = False  # a bool() read answered False (a padded batch's mask)
    compiled: bool = False  # inside a torch.compile'd call
    function: str = ""   # the library function that read (HostRead.function)


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
    """Everything that happened between two step ends (or after the last one)."""

    step: int | None                          # the step label; None: after the last step
    is_step: bool
    events: list[tuple[XlaEvent, str]]        # (event, phase)
    unlogged_compiles: int                    # compiles the counters saw and the log did not
    compile_times: list[float | None]         # seconds, per compile, log order
    hlo: dict[int, hlo_diff.HloSummary]       # index into events -> the compiled graph
    reads: list[HostRead]
    fallbacks: dict[str, int]                 # CPU fallback op -> new executions
    scalar_reads: int                         # new aten::_local_scalar_dense
    scalars: list[ScalarChange]               # optimizer scalars that became / stopped being 0 or 1
    phase: str
    optimizer_steps: list[int] = field(default_factory=list)    # n for an optimizer's n-th step()
    loaders: list[LoaderOrigin] = field(default_factory=list)   # DataLoaders made in this window
    batches: list[Batch] = field(default_factory=list)          # batches those loaders produced
    refused: list[Refused] = field(default_factory=list)
    dynamo: list[DynamoNote] = field(default_factory=list)      # dynamo recompiles, limits, graph breaks
    eager: bool = False                       # torch_xla's eager mode was on (each op compiles and runs)
    compiled_at: str = ""                     # the user's line of the last torch.compile'd call (hooks)


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
    fix: str = ""                  # what to change (library-aware); FIXES[cause] when ""


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
        if self.run is not None:
            r = self.run
            return {"format": REPORT_FORMAT, "command": r.command, "exit_code": r.exit_code,
                    "killed_by": r.killed_by, "interrupted_by": r.interrupted_by, "command_tail": r.command_tail,
                    "warmup_steps": self.warmup_steps, "max_graphs": r.max_graphs, "steps": self.steps,
                    "distinct_graphs": len(graphs), "compile_count": self.compile_count,
                    "compile_time_s": self.compile_time_s, "graphs": graphs, "late_graphs": late,
                    "recompiles": recompiles, "host_syncs": host, "fallback_ops": fallback, "dynamo": dynamo,
                    "processes": [p.to_json() for p in r.processes], **verdict}
        who = ({"pid": self.pid, "argv": self.argv, "rank": self.rank, "local_rank": self.local_rank}
               if self.pid is not None else {})
        return {**who, "warmup_steps": self.warmup_steps, "steps": self.steps, "distinct_graphs": len(graphs),
                "graphs": graphs, "late_graphs": late, "recompiles": recompiles, "host_syncs": host,
                "scalar_reads_after_warmup": self.scalar_reads_after_warmup, "fallback_ops": fallback,
                "dynamo": dynamo, "source": self.source, **verdict, "compile_count": self.compile_count,
                "compile_time_s": self.compile_time_s,
                **({"input_shapes": self.input_shapes} if self.pid is not None else {})}

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
                   local_rank=data.get("local_rank"), input_shapes=data.get("input_shapes", {}), run=run)
