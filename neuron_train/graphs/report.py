"""The text report of `neuron-train check-graphs` (and of assert_graph_stable): one line per graph,
then recompilations, late graphs, host syncs, CPU fallbacks and the verdict."""

from __future__ import annotations

from neuron_train.common.fileio import short
from neuron_train.graphs.causes import ACCUMULATION_REMAINDER, fix_for
from neuron_train.graphs.findings import DynamoEntry
from neuron_train.graphs.records import Graph, GraphReport


def format_report(r: GraphReport) -> str:
    warmup = f", plus every graph of the first {r.warmup_steps} steps" if r.warmup_steps else ""
    lines = [f"graphs: {len(r.graphs)} distinct, {r.compile_count} compiles "
             f"({_seconds(r.compile_time_s)}) over {r.steps} steps (syncs that ran a graph); "
             f"warm-up: each call site's graphs until it repeats one{warmup}"]
    for n, g in enumerate(r.graphs, 1):
        lines.append(f"  #{n} {(g.hash or 'no hash')[:12]:12}  step {str(g.step):>5}  {g.phase:10} "
                     f"{g.kind:9}  {_seconds(g.compile_time_s):>7}  {short(g.site[0] if g.site else '')}")
        if not g.hash:
            lines.append(f"      {g.detail}")
    recompiles, late = r.recompiles, r.late_graphs
    lines.append(recompile_headline(r))
    for g in recompiles:
        site = g.site[0] if g.site else ""
        compiled = f" (graph compiled at {short(site)})" if site and site != g.where else ""
        lines += [f"  step {g.step} ({g.phase}): {g.cause} at {at(g.where, g.library)}{compiled}",
                  *([f"    {g.detail}"] if g.detail else []),
                  f"    fix: {g.fix or fix_for(g.cause, '')}"]
    lines.append(f"late graphs (new call sites once the run was steady; precompile must cover them): {len(late)}")
    for g in late:
        lines.append(f"  step {g.step} ({g.phase}): {g.cause} at {at(g.where, g.library)}")
        if g.cause == ACCUMULATION_REMAINDER:  # a late graph with a cause of its own: what made it, the fix
            lines += [f"    {g.detail}", f"    fix: {g.fix}"]
    lines.append(f"host syncs after warm-up: {len(r.host_syncs)}")
    for h in r.host_syncs:
        effect = (f"{h.cause}: runs a graph before the step's sync" if h.executes_graph
                  else "waits for the device, no extra graph")
        often = ("refused inside torch_xla.compile(full_graph=True)" if h.refused else "every step"
                 if h.every_step else f"steps {', '.join(map(str, h.steps))}")
        lines.append(f"  {at(h.where, h.library)}: {h.what} x{h.count} ({often}; {effect})")
        if h.executes_graph and h.library:
            lines.append(f"    fix: {h.fix or fix_for(h.cause, h.library)}")
    dynamo = r.dynamo
    if dynamo:
        defects = sum(d.defect for d in dynamo)
        lines.append(f"torch.compile (dynamo): {defects} recompilation(s) after warm-up or fall-back(s) to eager, "
                     f"{sum(d.kind == 'graph_break' for d in dynamo)} graph break(s)")
        for d in dynamo:
            if d.defect or d.kind == "graph_break":
                count = f" x{d.count}" if d.count > 1 else ""
                lines.append(f"  step {d.step}: {d.cause}{count} of {d.function} at "
                             f"{at(d.where, d.library)}: {d.reason}")
        fixes = {d.fix for d in dynamo if d.defect and not d.graph}
        lines += [f"    fix: {fix}" for fix in sorted(fixes)]
    fallbacks = r.fallback_ops
    lines.append(f"CPU fallback ops: {len(fallbacks)}")
    for op, f in fallbacks.items():
        lines.append(f"  {op} x{f.count} from step {f.first_step}"
                     + (f" at {', '.join(map(short, f.where))}" if f.where else ""))
    if r.run is not None and r.run.command_tail:
        lines.append("the command failed; its last lines:")
        lines += [f"  | {line}" for line in r.run.command_tail]
    verdict = "graph-stable" if r.stable else "NOT graph-stable"
    lines.append(f"verdict: {verdict}" + "".join(f"\n  - {p}" for p in r.problems))
    return "\n".join(lines)


def recompile_headline(r: GraphReport) -> str:
    """The first count: every recompilation, the dynamo ones that made no XLA graph of their own too
    (those that did are among the graphs already), so it never contradicts the dynamo section."""
    graphs = len(r.recompiles)
    dynamo = sum(d.defect and d.kind == "recompile" and not d.graph for d in r.dynamo)
    if not dynamo:
        return f"recompilations (new graphs at warm call sites): {graphs}"
    return (f"recompilations: {graphs + dynamo} ({graphs} new graphs at warm call sites, {dynamo} torch.compile "
            "(dynamo) recompilations after warm-up, listed under torch.compile below)")


def recompile_problems(recompiles: list[Graph]) -> list[str]:
    """One line per cause and line: a mask that recompiles every step is one problem."""
    grouped: dict[tuple, list[Graph]] = {}
    for g in recompiles:
        grouped.setdefault((g.cause, g.where), []).append(g)
    out = []
    for (cause, where), graphs in grouped.items():
        steps = ", ".join(str(g.step) for g in graphs[:5]) + (", ..." if len(graphs) > 5 else "")
        count = f"{len(graphs)} recompilations" if len(graphs) > 1 else "recompilation"
        out.append(f"{count} at step {steps} ({graphs[0].phase}): {cause} at {at(where, graphs[0].library)}")
    return out


def dynamo_problems(notes: list[DynamoEntry]) -> list[str]:
    """Dynamo recompilations that made no new graph of their own (reported with the graph otherwise)
    and the fall-back to eager, one line per cause and line."""
    grouped: dict[tuple[str, str, str], list[DynamoEntry]] = {}
    for d in notes:
        if d.defect and not d.graph:
            grouped.setdefault((d.cause, d.where, d.function), []).append(d)
    out = []
    for (cause, where, function), found in grouped.items():
        steps = ", ".join(str(d.step) for d in found[:5]) + (", ..." if len(found) > 5 else "")
        count = f"{len(found)} times" if len(found) > 1 else "once"
        out.append(f"{cause} of {function} {count}, at step {steps} ({found[0].phase}): "
                   f"{found[-1].reason} at {at(where, found[0].library)}")
    return out


def at(where: str, library: str = "") -> str:
    """`tests/x.py:47`, or `transformers/masking_utils.py:369, from tests/x.py:47`: the library line
    that made the graph, the shape or the read, then the user's line that led there."""
    return f"{library}, from {short(where) or '?'}" if library else short(where) or "?"


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f} s"
