"""Why did a warm call site compile a new graph, and which line should change? (pure Python)

The HLO diff (hlo_diff.py) says what changed: an input shape, a constant 0/1, the program. Other
sources then name the line to fix: a CPU fallback op's line (a data-dependent shape), the LR
scheduler or optimizer step that moved a hyperparameter to or from 0/1, and the DataLoader (or
its collate_fn) whose batches have the new input shape, the user's slice that cut an input to a new
length, or the Python `if` that chose which ops a step traced (source.py reads the user's script).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from neuron_train.common.fileio import short
from neuron_train.graphs import hlo_diff, source
from neuron_train.graphs.causes import (
    DATA_DEPENDENT,
    FSDP_AFTER_EVAL,
    GRAPH_STRUCTURE,
    GROWING_CONCAT,
    NEW_CONSTANT,
    NEW_INPUT_SHAPE,
    PYTHON_BRANCH,
    SLICE_SHAPE,
    UNKNOWN,
)
from neuron_train.graphs.findings import DynamoEntry
from neuron_train.graphs.records import Batch, Graph, LineReads, LoaderOrigin, ScalarChange, Window

SHAPES_SHOWN = 64          # recent runs of the site shown (grouped) in "input N by step"
SHAPES_KEPT = 256          # distinct batch shapes remembered per loader
_DIMS = re.compile(r"\[.*\]$")
COLLATED = "the shape is made by collate_fn"  # the detail's words when the loader's collate_fn made it
_MECHANISM = "/torch"  # torch and torch_xla files: the mechanism every graph passes through, never named


@dataclass
class Loaders:
    """The DataLoaders a process made and the batch shapes each one yielded."""

    origins: dict[str, LoaderOrigin] = field(default_factory=dict)
    shapes: dict[str, set[str]] = field(default_factory=dict)

    def observe(self, w: Window) -> None:
        for origin in w.of(LoaderOrigin):
            self.origins[origin.key] = origin
        for batch in w.of(Batch):
            seen = self.shapes.setdefault(batch.loader, set())
            if len(seen) < SHAPES_KEPT:
                seen.update(batch.shapes)

    def made_at(self, where: str) -> LoaderOrigin | None:
        """The loader made at (or whose collate_fn is defined at) `where`; the latest one."""
        found = [o for o in self.origins.values() if where in (o.where, o.collate_where)]
        return found[-1] if found else None

    def ragged_in(self, w: Window) -> LoaderOrigin | None:
        """The loader whose ragged last batch was fetched in `w`, if any."""
        for batch in w.of(Batch):
            origin = self.origins.get(batch.loader)
            remainder = _remainder(origin) if origin is not None else 0
            if remainder and any(_first_dim(s) == remainder for s in batch.shapes):
                return origin
        return None

    def accumulation_remainder(self) -> tuple[LoaderOrigin, int] | None:
        """The Trainer's loader whose batches per epoch are no multiple of its gradient_accumulation_steps,
        and that count of batches."""
        for origin in self.origins.values():
            if origin.accumulation > 1 and origin.samples and origin.batch_size:
                full, ragged = divmod(origin.samples, origin.batch_size)
                batches = full + (bool(ragged) and not origin.drop_last)
                if batches % origin.accumulation:
                    return origin, batches
        return None

    def ragged_batch(self, shapes: list[str]) -> tuple[LoaderOrigin, str, str] | None:
        """(loader, its ragged last batch's shape among `shapes`, that shape at the full batch size) of a
        loader that yielded both: a graph traced on its last batch."""
        for key, seen in self.shapes.items():
            origin = self.origins.get(key)
            if origin is None or not (remainder := _remainder(origin)):
                continue
            for shape in sorted(shapes, key=lambda s: -s.count(",")):  # the batch's widest tensor first
                full = shape.replace(f"[{remainder}", f"[{origin.batch_size}", 1)
                if _first_dim(shape) == remainder and shape in seen and full in seen:
                    return origin, shape, full
        return None

    def source_of(self, shapes: list[str]) -> LoaderOrigin | None:
        """The loader whose batches had one of `shapes` (exact type first, then dimensions only:
        XLA_USE_BF16 turns f32 inputs into bf16 ones)."""
        for key_of in (lambda s: s, lambda s: m[0] if (m := _DIMS.search(s)) else s):
            wanted = {key_of(s) for s in shapes}
            for key, seen in self.shapes.items():
                if wanted & {key_of(s) for s in seen} and key in self.origins:
                    return self.origins[key]
        return None


@dataclass
class Context:
    """What a recompilation is explained from, besides the two graphs."""

    window: Window
    reads: dict[str, LineReads]      # this window's host reads by line (hostsync.reads_by_line)
    loaders: Loaders
    runs: list[tuple[object, str]]   # (step, graph hash) of the call site's runs, oldest first
    step: object                     # the step this graph compiled in
    hlo: dict[str, hlo_diff.HloSummary]
    is_internal: Callable[[str], bool]
    follows: tuple[Graph, list[str]] | None = None  # a recompilation just before, and its output shapes
    library_of: Callable[[str], str] = field(default=lambda path: "")  # package-relative library file


def explain(base: hlo_diff.HloSummary | None, new: hlo_diff.HloSummary | None, where: str,
            ctx: Context, library: str = "") -> tuple[str, str, str, str]:
    """(cause, detail, line, library line) of a new graph at a warm call site whose last graph was
    `base`; `library` is the library line that ran it."""
    cat = grown(base, new)
    if cat is not None and base is not None and new is not None:
        return _grown_detail(base, new, cat, where, ctx, library)
    if base is not None and new is not None:
        why = hlo_diff.explain(base, new, ctx.is_internal)
    else:
        why = hlo_diff.Explanation(UNKNOWN, "no HLO dump of the two graphs to compare (XLA_FLAGS has the "
                                   "user's own --xla_dump_to, or the dump was not written)")
    cause, detail, line = _explain(base, new, why, where, ctx)
    if line != where or cause == NEW_INPUT_SHAPE:  # a loader's line: its library line is the loader's
        origin = ctx.loaders.made_at(line)
        library = origin.library if origin is not None else "" if line != where else library
        if origin is not None and COLLATED in detail and ctx.is_internal(origin.collate_where.rpartition(":")[0]):
            library = _named(origin.collate_where, ctx)  # a library's collator (DataCollatorWithPadding)
    if line == where and not library and why.library:
        library = _named(why.library, ctx)  # the op was traced inside a library: its line, then the user's
    return cause, detail, line, library


def _named(where: str, ctx: Context) -> str:
    """`timm/data/mixup.py:211` for a library file's line (the path as is when no package names it; ""
    for torch's and torch_xla's own files)."""
    file, _, line = where.rpartition(":")
    name = ctx.library_of(file)
    return f"{name}:{line}" if name else "" if ctx.is_internal(file) and _MECHANISM in file else short(where)


def _explain(base: hlo_diff.HloSummary | None, new: hlo_diff.HloSummary | None, why: hlo_diff.Explanation,
             where: str, ctx: Context) -> tuple[str, str, str]:
    cause, detail, line = why.cause, why.detail, why.where or where
    w = ctx.window
    fallback_lines = [ln for ln, r in ctx.reads.items() if r.kind == "fallback"]
    if w.fallbacks and fallback_lines and cause in (NEW_INPUT_SHAPE, GRAPH_STRUCTURE, UNKNOWN):
        ops = ", ".join(sorted(w.fallbacks))
        return DATA_DEPENDENT, f"{ops} ran on the CPU and its result's shape reached the graph ({why.detail})", \
            fallback_lines[0]
    called = _fallback_call(w, why, where, ctx) if cause in (NEW_INPUT_SHAPE, GRAPH_STRUCTURE, UNKNOWN) else ""
    if called:  # no graph ran for the op (its input was ready): the user's call of it, from the source
        return DATA_DEPENDENT, (f"{', '.join(sorted(w.fallbacks))} ran on the CPU (called at {short(called)}) and "
                                "its result's shape, which depends on the data, reached the graph "
                                f"({why.detail})"), called
    if cause == NEW_INPUT_SHAPE and base and new and slice_made(base, new, ctx.is_internal, ctx.loaders, w):
        return SLICE_SHAPE, (f"{detail}; the slice at {short(why.where)} cut the input to another length; "
                             f"{_per_step(_changed(base, new)[0], new, ctx.step, ctx)}"), why.where
    cut = _sliced(base, new, why)
    if cut:  # the same ops with another length, first at a slice whose bound is computed
        return SLICE_SHAPE, f"{detail}; the slice at {_named(cut, ctx)} cut a tensor to another length", line
    if cause == GRAPH_STRUCTURE and _barriers_changed(base, new):
        assert base is not None and new is not None  # _barriers_changed had both
        return FSDP_AFTER_EVAL, (f"{len(base.params)} -> {len(new.params)} inputs, {detail}: the first training "
                                 "step after an evaluation takes the full parameters the evaluation's forward left "
                                 "gathered (torch_xla FSDP), with fewer optimization barriers"), line
    written = next((s for s in w.of(ScalarChange) if s.module and s.where), None)
    if written is not None and cause in (NEW_CONSTANT, GRAPH_STRUCTURE, UNKNOWN) and not why.where:
        return NEW_CONSTANT, f"{detail}; {_module_detail(written)}", written.where
    branch = source.branch_at(line, where) if cause == GRAPH_STRUCTURE and _other_program(base, new) else ""
    if branch:
        return PYTHON_BRANCH, f"{detail}; the Python `if` at {short(branch)} chose which ops this step traced", \
            branch
    if cause == NEW_CONSTANT and not why.where and w.of(ScalarChange):
        return cause, detail + _scalar_detail(w.of(ScalarChange)[0]), w.of(ScalarChange)[0].where or line
    if cause == NEW_INPUT_SHAPE and base is not None and new is not None:
        if ctx.follows is not None and _fed_by(base, new, ctx.follows[1]):
            first = ctx.follows[0]
            return first.cause, (f"{detail}: the output of graph {first.hash[:12]}, recompiled at step "
                                 f"{first.step} ({first.cause})"), first.where
        return (cause, *_input_source(base, new, line, detail, ctx))
    return cause, detail, line


def not_the_read(base: hlo_diff.HloSummary | None, new: hlo_diff.HloSummary | None, ctx: Context) -> bool:
    """Did something else than a read in the same window make the new graph: an optimizer scalar that
    left (or reached) exactly 0 or 1 when the graphs differ by that constant, or FSDP's parameters an
    evaluation left gathered? Then the read (an evaluation's `.item()`) did not split the step."""
    if _barriers_changed(base, new):
        return True
    if not ctx.window.of(ScalarChange):
        return False
    return base is None or new is None or hlo_diff.explain(base, new, ctx.is_internal).cause == NEW_CONSTANT


def _barriers_changed(base: hlo_diff.HloSummary | None, new: hlo_diff.HloSummary | None) -> bool:
    """torch_xla's FSDP after an evaluation: the forward left the full parameters gathered, so the next
    training step takes them as inputs and gathers less behind fewer optimization barriers."""
    if base is None or new is None or len(base.params) == len(new.params):
        return False
    barriers = [sum(i.opcode == "opt-barrier" for i in s.instrs) for s in (base, new)]
    return barriers[0] != barriers[1] and min(barriers) > 0


def _fallback_call(w: Window, why: hlo_diff.Explanation, where: str, ctx: Context) -> str:
    """The user's call of a CPU fallback op of this window whose result made the difference: the graphs
    differ at a library line (the op's own Python, e.g. torch/functional.py for torch.unique), not the
    user's, and the user's file calls the op."""
    if not w.fallbacks or why.where or not why.library or not ctx.is_internal(why.library.rpartition(":")[0]):
        return ""
    return next((line for op in sorted(w.fallbacks) if (line := source.call_of(op, where))), "")


def slice_made(base: hlo_diff.HloSummary | None, new: hlo_diff.HloSummary | None,
               is_internal: Callable[[str], bool], loaders: Loaders, w: Window,
               follows: tuple[Graph, list[str]] | None = None) -> bool:
    """Did a slice with a computed length make the only difference? An input's shape cut by the user's
    slice, the same ops cut to another length on the device (the user's slice, or a library's: timm's
    CutMix box), or an input made by such a graph just recompiled (torch_xla.compile runs the slice
    pending before the step as a graph of its own). Not when a loader's ragged last batch came in
    this window: the loader made it (named at the loader)."""
    if base is None or new is None or loaders.ragged_in(w) is not None:
        return False
    why = hlo_diff.explain(base, new, is_internal)
    fed = follows is not None and follows[0].cause == SLICE_SHAPE and _fed_by(base, new, follows[1])
    return fed or bool(_sliced(base, new, why)) or (
        why.cause == NEW_INPUT_SHAPE and bool(why.where) and source.slice_at(why.where))


def _sliced(base: hlo_diff.HloSummary | None, new: hlo_diff.HloSummary | None, why: hlo_diff.Explanation) -> str:
    """The slice (`file:line`, the user's or a library's) where two graphs with the same ops part, when
    that line cuts with a computed bound; "" otherwise. Other ops at that line only count too: a slice
    to the whole length (`data[:, :32]` of 32 tokens) is no op at all."""
    line = why.where or why.library
    if why.cause != GRAPH_STRUCTURE or base is None or new is None or not line or not source.slice_at(line):
        return ""
    elsewhere = [[i.opcode for i in s.instrs if i.where != line] for s in (base, new)]
    return line if not _other_program(base, new) or elsewhere[0] == elsewhere[1] else ""


def grown(base: hlo_diff.HloSummary | None, new: hlo_diff.HloSummary | None) -> hlo_diff.Instr | None:
    """The concatenation that grows a tensor from run to run, if that is the only difference: every
    input that changed shape is a result the site's last graph concatenated (an accumulator such as
    `preds = torch.cat([preds, logits])`, or the HF Trainer's eval loop), and this graph concatenates it
    again. Returns the new graph's concatenation (its line, when traced with lines, is the one to fix)."""
    if base is None or new is None or len(base.params) != len(new.params):
        return None
    made = {i.shape for i in base.instrs if i.opcode == "concatenate"} & set(base.outputs)
    changed = [b.shape for a, b in zip(base.params, new.params, strict=True) if a.shape != b.shape]
    cats = [i for i in new.instrs if i.opcode == "concatenate"]
    if not changed or not cats or not all(shape in made for shape in changed):
        return None
    made_here = [i for i in base.instrs if i.opcode == "concatenate" and i.shape in made]
    return next((i for i in cats + made_here if i.where), cats[0])  # a graph traced without lines: the last


def _grown_detail(base: hlo_diff.HloSummary, new: hlo_diff.HloSummary, cat: hlo_diff.Instr, where: str,
                  ctx: Context, library: str) -> tuple[str, str, str, str]:
    """(cause, detail, line, library line) of a tensor grown by concatenation: the concatenation's own
    line when it is the user's, else the library's line and the user's line that called into it."""
    changed = _changed(base, new)
    shapes = ", ".join(f"input {i}: {base.params[i].shape} -> {new.params[i].shape}" for i in changed[:3])
    file, _, line = cat.where.rpartition(":")
    name = ctx.library_of(file) if file else ""
    mine = bool(file) and not ctx.is_internal(file)
    at = (f"{name}:{line}" if name else short(cat.where)) or "?"
    detail = (f"{shapes}: the tensor the last run concatenated (torch.cat at {at}) is concatenated again, "
              f"longer every run, so every run is a new graph; {_per_step(changed[0], new, ctx.step, ctx)}")
    return GROWING_CONCAT, detail, cat.where if mine else where, "" if mine else f"{name}:{line}" if name else library


def _other_program(base: hlo_diff.HloSummary | None, new: hlo_diff.HloSummary | None) -> bool:
    """Other ops, not the same ops with other lengths (a slice or loop length makes that)."""
    if base is None or new is None:
        return False
    return len(base.instrs) != len(new.instrs) or any(
        a.opcode != b.opcode for a, b in zip(base.instrs, new.instrs, strict=True))


def _changed(base: hlo_diff.HloSummary, new: hlo_diff.HloSummary) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(base.params, new.params, strict=False)) if a.shape != b.shape]


def _fed_by(base: hlo_diff.HloSummary, new: hlo_diff.HloSummary, outputs: list[str]) -> bool:
    """Every input that changed shape has the shape of an output of the graph that ran just before
    (torch_xla.compile runs the work pending before the step as a graph of its own)."""
    changed = [b.shape for a, b in zip(base.params, new.params, strict=False) if a.shape != b.shape]
    return bool(changed) and all(shape in outputs for shape in changed)


def _scalar_detail(change: ScalarChange) -> str:
    text = f"; optimizer param_groups[{change.group}]['{change.key}'] = {change.value}"
    if change.scheduler:
        text += f", set by the {change.scheduler} made at {short(change.where)}"
    if change.value not in (0, 1):  # it was 0 or 1 until now: baked into the earlier graphs
        text += (f" (it was exactly 0 or 1 until then, a constant in the graphs before; {change.value} is "
                 "graph data, so the step compiled anew)")
    return text


def _module_detail(change: ScalarChange) -> str:
    now = "reached" if change.value in (0, 1) else "left"
    return (f"{change.module}.{change.key} = {change.value} written at {short(change.where)}: it {now} exactly 0 or 1, "
            "which torch_xla bakes into the graph as a constant (at p=0 torch leaves the dropout out), so the "
            "step traced another graph")


def _input_source(base: hlo_diff.HloSummary, new: hlo_diff.HloSummary, line: str, detail: str,
                  ctx: Context) -> tuple[str, str]:
    """(detail, line): the loader or collate_fn that made the new shape, and the shapes per step."""
    changed = _changed(base, new)
    if not changed:
        return detail, line
    per_step = _per_step(changed[0], new, ctx.step, ctx)
    origin = ctx.loaders.source_of([new.params[i].shape for i in changed])
    if origin is None:
        return f"{detail}; {per_step}", line
    remainder = _remainder(origin)
    ragged = remainder and any(_first_dim(new.params[i].shape) == remainder for i in changed)
    if origin.collate and not ragged:
        mine = origin.collate_where and not ctx.is_internal(origin.collate_where.rpartition(":")[0])
        grouped = (" (the Trainer's group_by_length, TrainingArguments(train_sampling_strategy=\"group_by_length\") "
                   "or group_by_length=True before transformers 5: its LengthGroupedSampler batches samples of "
                   "similar length, so each batch is padded to another length; padded to one length, grouping "
                   "only saves padding)") if origin.grouped else ""
        return (f"{detail}; {COLLATED} {origin.collate} ({short(origin.collate_where)}) "
                f"of the DataLoader at {short(origin.where)}{grouped}; {per_step}",
                origin.collate_where if mine else origin.where)
    sizes = f"batch_size {origin.batch_size}, drop_last={origin.drop_last}"
    if remainder:
        sizes += f", {origin.samples} samples: each pass ends with a batch of {remainder}"
    return f"{detail}; the batches come from the DataLoader at {short(origin.where)} ({sizes}); {per_step}", \
        origin.where


def _remainder(origin: LoaderOrigin) -> int:
    """The size of a loader's ragged last batch; 0 when every batch is full."""
    if origin.samples is None or not origin.batch_size or origin.drop_last:
        return 0
    return origin.samples % origin.batch_size


def _first_dim(shape: str) -> int | None:
    dims = shape.partition("[")[2].rstrip("]").split(",")
    return int(dims[0]) if dims and dims[0].isdigit() else None


def _per_step(index: int, new: hlo_diff.HloSummary, step: object, ctx: Context) -> str:
    """`input 0 by step: 1-26 f32[48,784], 27 f32[32,784]` (the site's recent runs, then this one)."""
    runs = [(s, ctx.hlo[g].params[index].shape) for s, g in ctx.runs[-SHAPES_SHOWN:]
            if g in ctx.hlo and index < len(ctx.hlo[g].params)]
    runs.append((step, new.params[index].shape))
    groups: list[list] = []
    for s, shape in runs:
        if groups and groups[-1][2] == shape:
            groups[-1][1] = s
        else:
            groups.append([s, s, shape])
    text = ", ".join(f"{a} {shape}" if a == b else f"{a}-{b} {shape}" for a, b, shape in groups)
    return f"input {index} by step: {text}"


_GUARDED_KEY = re.compile(r"param_groups\[\d+\]\[['\"](\w+)['\"]\]")


def guarded_write(note: DynamoEntry) -> None:
    """A dynamo guard on an optimizer hyperparameter (`self.param_groups[0]['lr'] == 0.09`) that the
    user's script writes as a Python number (`g["lr"] = lr`): named at that write, with a fix that
    survives it (an LR tensor alone is replaced by the next float written)."""
    key = _GUARDED_KEY.search(note.reason)
    if key is None or not note.where:
        return
    name = key.group(1)
    written = source.key_written(note.where.rpartition(":")[0], name)
    if not written:
        return
    note.detail = f"the guarded value is written at {short(written)}, called from {short(note.where)}"
    note.where, note.library = written, ""
    note.fix = (f"create the optimizer with {name}=torch.tensor(...) and write the new value into it in place, "
                   f"g[\"{name}\"].fill_(value), at this line: assigning a Python number (g[\"{name}\"] = value) "
                   "changes what dynamo guards on, so the optimizer step recompiles every time")
