"""Fixes more precise than a cause's own (pure Python): the optimizer or module scalar that moved, the
CPU fallback op that ran, and the Trainer's gradient-accumulation remainder with its arithmetic."""

from __future__ import annotations

from typing import TYPE_CHECKING

from neuron_train.graphs.causes import ACCUMULATION_REMAINDER, DATA_DEPENDENT, FALLBACK_FIXES, NEW_CONSTANT
from neuron_train.graphs.records import Graph, ScalarChange
from neuron_train.graphs.report import short

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


def fix_of(graph: Graph, ctx: Context) -> str:
    """A fix more precise than the cause's: for the optimizer or module scalar that moved, the fallback
    op that ran."""
    changed = [s for s in ctx.window.scalars if s.where == graph.where]
    if graph.cause == NEW_CONSTANT and changed and changed[0].module:
        return (f"keep {changed[0].module}.{changed[0].key} away from exactly 0 and 1 where it is written: end an "
                f"anneal just above 0 ({changed[0].key} = max(1e-6, ...)) so every step traces the same op with "
                "the value as graph data; or set it once, before the first step")
    if graph.cause == NEW_CONSTANT and changed:
        return _scalar_fix(changed[0])
    if graph.cause == DATA_DEPENDENT:
        return next((FALLBACK_FIXES[op] for op in sorted(ctx.window.fallbacks) if op in FALLBACK_FIXES), "")
    return ""


def _scalar_fix(change: ScalarChange) -> str:
    """The fix for an optimizer scalar that reached or left exactly 0 or 1."""
    if change.value not in (0, 1):
        return (f"start {change.key} away from exactly 0 and 1 (e.g. 0.999 rather than 1.0, a warm-up from "
                f"1e-8 rather than 0): torch_xla bakes those two values into the graph as constants, so the "
                f"first value the {change.scheduler or 'schedule'} moves it to compiles a new step graph")
    return (f"keep {change.key} away from exactly 0 and 1 (end a decay at min_lr=1e-8, stop a schedule short "
            "of 1.0): torch_xla bakes those two values into the graph as constants, a new step graph")
