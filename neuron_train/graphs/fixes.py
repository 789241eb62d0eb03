"""Fixes more precise than a cause's own (pure Python): the optimizer or module scalar that moved, the
CPU fallback op that ran, the Trainer's gradient-accumulation remainder and a ragged last batch synced at
a call site of its own (the Trainer's end of epoch), each with its arithmetic."""

from __future__ import annotations

from typing import TYPE_CHECKING

from neuron_train.common.fileio import short
from neuron_train.graphs import hlo_diff
from neuron_train.graphs.causes import (
    ACCUMULATION_REMAINDER,
    DATA_DEPENDENT,
    NEW_CONSTANT,
    NEW_INPUT_SHAPE,
    fallback_fix,
)
from neuron_train.graphs.records import Graph, ScalarChange

if TYPE_CHECKING:
    from neuron_train.graphs.explain import Context


def accumulation_remainder(graph: Graph, ctx: Context) -> bool:
    """A new step graph the Trainer ran in a window with an optimizer step, when its loader's batches per
    epoch leave a shorter last accumulation window: named as that remainder (setting, arithmetic, fixes)."""
    found = ctx.loaders.accumulation_remainder()
    if found is None or not ctx.window.optimizer_steps or not graph.library.startswith("transformers/trainer.py"):
        return False
    origin, batches = found
    accumulation = origin.accumulation
    windows = [accumulation] * (batches // accumulation) + [batches % accumulation]
    shown = ", ".join(map(str, windows)) if len(windows) <= 6 else f"{accumulation}, ..., {accumulation}, {windows[-1]}"
    graph.cause = ACCUMULATION_REMAINDER
    graph.detail = (f"TrainingArguments(gradient_accumulation_steps={accumulation}) with {batches} batches an epoch "
                    f"(the DataLoader at {short(origin.where)}: {origin.samples} samples, batch_size "
                    f"{origin.batch_size}): windows of {shown} batches; the epoch's last window of {windows[-1]} "
                    "traces another step graph (compiled once, run at every epoch's end)")
    multiple, size = batches - batches % accumulation, origin.batch_size or 1
    graph.fix = (f"make the batches per epoch a multiple of {accumulation} ({multiple} or {multiple + accumulation} "
                 f"batches: {multiple * size} or {(multiple + accumulation) * size} "
                 f"samples), or a gradient_accumulation_steps that divides {batches}; dataloader_drop_last=True "
                 "helps only when a ragged last batch alone makes the remainder; or accept the one extra graph "
                 "(compiled once, run every epoch) and precompile it")
    return True


def ragged_batch(graph: Graph, hlo: hlo_diff.HloSummary | None, ctx: Context) -> bool:
    """A graph at a new call site traced on a loader's ragged last batch: a recompilation for that batch's
    shape, named at the loader with the arithmetic and its fixes. The transformers Trainer lets the loader's
    next fetch sync each step (MpDeviceLoader), so an epoch's last step is synced by its end-of-epoch
    mark_step: the ragged batch's graph compiles there, a call site no full batch's step reached."""
    found = ctx.loaders.ragged_batch([p.shape for p in hlo.params]) if hlo is not None else None
    if found is None:
        return False
    origin, ragged, full = found
    if ctx.follows is not None and (ctx.follows[0].cause, ctx.follows[0].where) == (NEW_INPUT_SHAPE, origin.where):
        return False  # this batch's recompilation was just reported (a read ran part of its step first): one report
    samples, size = origin.samples or 0, origin.batch_size or 1  # both known: the loader has a ragged batch
    batches, remainder = divmod(samples, size)
    synced = f" (the sync at {graph.library})" if graph.library else ""
    graph.kind, graph.cause = "recompile", NEW_INPUT_SHAPE
    graph.detail = (f"a ragged last batch: {samples} samples in batches of {size} (drop_last=False) from the "
                    f"DataLoader at {short(origin.where)}: {batches} full batches and a last one of {samples} mod "
                    f"{size} = {remainder}; its input {full} -> {ragged} traces another step graph, compiled at the "
                    f"epoch's end{synced} and run at every epoch's end")
    graph.where, graph.library = origin.where, origin.library
    divisible = " or ".join(str(n * size) for n in (batches, batches + 1) if n)
    drop = ("TrainingArguments(dataloader_drop_last=True)" if origin.library.startswith("transformers/trainer.py")
            else f"drop_last=True on the DataLoader at {short(origin.where)}")
    graph.fix = (f"{drop} (leaves out the last {remainder} samples of each epoch), or a dataset that is a "
                 f"multiple of {size} ({divisible} samples), or accept the one extra graph (compiled once, run every "
                 "epoch) and precompile it")
    return True


def fix_of(graph: Graph, ctx: Context) -> str:
    """A fix more precise than the cause's: for the optimizer or module scalar that moved, the fallback
    op that ran."""
    changed = [s for s in ctx.window.of(ScalarChange) if s.where == graph.where]
    if graph.cause == NEW_CONSTANT and changed and changed[0].module:
        return (f"keep {changed[0].module}.{changed[0].key} away from exactly 0 and 1 where it is written: end an "
                f"anneal just above 0 ({changed[0].key} = max(1e-6, ...)) so every step traces the same op with "
                "the value as graph data; or set it once, before the first step")
    if graph.cause == NEW_CONSTANT and changed:
        return _scalar_fix(changed[0])
    if graph.cause == DATA_DEPENDENT:
        return next((fix for op in sorted(ctx.window.fallbacks) if (fix := fallback_fix(op))), "")
    return ""


def _scalar_fix(change: ScalarChange) -> str:
    """The fix for an optimizer scalar that reached or left exactly 0 or 1."""
    if change.value not in (0, 1):
        return (f"start {change.key} away from exactly 0 and 1 (e.g. 0.999 rather than 1.0, a warm-up from "
                f"1e-8 rather than 0): torch_xla bakes those two values into the graph as constants, so the "
                f"first value the {change.scheduler or 'schedule'} moves it to compiles a new step graph")
    return (f"keep {change.key} away from exactly 0 and 1 (end a decay at min_lr=1e-8, stop a schedule short "
            "of 1.0): torch_xla bakes those two values into the graph as constants, a new step graph")
