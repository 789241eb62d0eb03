"""Classification, pure Python: step windows in; graphs, recompilations, late graphs, host syncs out.

The rule, per call site. A *call site* is the stack that ran a graph: a training loop's sync,
an eval loop's sync, each of torch_xla.compile's two syncs, a line that read a value. A site is
*warm* once a graph it ran runs again, there or at another site (a throughput clock or an eval
may flush the training graph once), or once it has run WARMUP_GRAPHS different ones (a site whose
every step is a new graph never repeats one). A new graph at a warm site is a *recompilation*, the
defect the checker exists for. The graphs a site compiles before it is warm are its *warm-up*
(an optimizer creates its state in its first step; an eval accumulator starts as a Python 0):
reported, never a defect; so are the graphs compiled in an optimizer's first two steps (but not a
new length a user's slice made: every new one is a recompilation, warm or not). A site
first seen once the run is steady (some site warm) compiles *late graphs*: not a defect either, but
precompile must cover them. A step is a sync that ran a graph; syncs with nothing pending (a
loader's first fetch, torch_xla.compile clearing pending work, a rendezvous) are not steps.

With compiles logged but not executions (PT_XLA_DEBUG_LEVEL=1, the cheap mode of a training run)
there is nothing to judge warmth by: every graph after `warmup_steps` steps counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from neuron_train.common.fileio import short
from neuron_train.graphs import hlo_diff
from neuron_train.graphs.causes import (
    DYNAMO_EAGER,
    DYNAMO_RECOMPILE,
    GRAPH_BREAK,
    GROWING_GRAPH,
    NEW_CALL_SITE,
    NEW_INPUT_SHAPE,
    UNKNOWN,
    WARMUP,
    error_problem,
    fix_for,
    read_cause,
)
from neuron_train.graphs.explain import (
    Context,
    Loaders,
    explain,
    grown,
    guarded_write,
    not_the_read,
    slice_made,
)
from neuron_train.graphs.findings import DynamoEntry
from neuron_train.graphs.fixes import accumulation_remainder, fix_of, ragged_batch
from neuron_train.graphs.hostsync import HostSyncs, in_closure, reads_by_line
from neuron_train.graphs.log import XlaEvent, library_frame, user_frames
from neuron_train.graphs.records import DynamoNote, ErrorNote, Graph, GraphReport, Refused, Window
from neuron_train.graphs.report import dynamo_problems, recompile_problems

OPTIMIZER_WARMUP_STEPS = 2  # an optimizer's first steps: state created, then its first steady step
WARMUP_GRAPHS = 3           # distinct graphs a site may run before it repeats one (first optimizer
                            # step, an accumulator's first value, a first LR of exactly 0)
GROWTH_STEPS = 3            # consecutive steps whose graphs grow: a loop without a sync
RUNS_KEPT = 64              # runs remembered per call site (for "input N by step")


@dataclass
class Site:
    seen: set[str] = field(default_factory=set)               # graphs this site has run
    graphs: list[str] = field(default_factory=list)           # compiled or run here, first time first
    warm: bool = False
    late: bool = False                                        # first seen once the run was steady
    last: str = ""                                            # the graph it ran last
    runs: list[tuple[object, str]] = field(default_factory=list)  # (step, graph) of recent runs
    sizes: list[tuple[int, object, int]] = field(default_factory=list)  # (step index, step, ops) per compile


@dataclass
class Analyzer:
    """Turns step windows into graphs, recompilations, late graphs and host syncs."""

    warmup_steps: int
    is_internal: Callable[[str], bool]
    executions_logged: bool = True
    steps: int = 0
    steady_steps: int = 0
    optimizer_step: int = 0           # the highest optimizer step seen (any optimizer's n-th step())
    steady_optimizer_steps: int = 0   # optimizer steps taken in steady windows
    last_step: int | None = None
    graphs: dict[str, Graph] = field(default_factory=dict)
    hlo: dict[str, hlo_diff.HloSummary] = field(default_factory=dict)  # graph hash -> its HLO
    sites: dict[tuple, Site] = field(default_factory=dict)
    home: dict[str, Site] = field(default_factory=dict)   # graph hash -> the site that first ran it
    executions: dict[str, int] = field(default_factory=dict)
    host: HostSyncs = field(default_factory=HostSyncs)
    loaders: Loaders = field(default_factory=Loaders)
    uses_log: bool = False
    warm_sites: int = 0
    last_new_graph: int = 0   # the step index of the latest graph compiled
    last_recompile: tuple[int, Graph, list[str]] | None = None  # (step index, graph, its output shapes)
    library_of: Callable[[str], str] = field(default=lambda path: "")  # package-relative library file
    dynamo: list[DynamoEntry] = field(default_factory=list)  # torch.compile's recompiles, limits, graph breaks
    phases: set[str] = field(default_factory=set)       # phases of the windows seen so far
    notes: list[ErrorNote] = field(default_factory=list)  # known errors the run ended with (hooks)
    scheduled: bool = False     # an LR scheduler was made (hooks): it, not a line of the script, writes the LR
    optimizer_where: str = ""   # the user's line of the first optimizer step (hooks): where a sync goes
    split_read: tuple[str, str, str] | None = None  # (line, cause, library line) of a read whose graphs
                                                    # are still compiling

    @property
    def steady(self) -> bool:
        return self._steady(self.steps)

    def _steady(self, index: int) -> bool:
        if index <= self.warmup_steps:
            return False
        return not self.executions_logged or self.warm_sites > 0

    def observe(self, w: Window) -> list[Graph]:
        """Record a window; returns the recompilations it revealed."""
        if w.is_step:
            self.steps += 1
            self.last_step = w.step
        index = self.steps if w.is_step else self.steps + 1
        steady = self._steady(index)
        self.steady_steps += steady and w.is_step
        before, self.optimizer_step = self.optimizer_step, max([self.optimizer_step, *w.optimizer_steps])
        self.steady_optimizer_steps += (self.optimizer_step - before) if steady else 0
        label = w.step if w.step is not None else self.last_step
        self.loaders.observe(w)
        reads = reads_by_line(w, self.is_internal, self.library_of)
        dynamo = self._dynamo_notes(w, index, label)
        found: list[Graph] = []
        times = iter(w.compile_times)
        # A read that ran a new graph, in this window or in the run of windows just before that each
        # compiled one (a Trainer's log reads, syncs in mesh_reduce, then fetches the next batch: the
        # pending rest of the step compiles as a graph of its own two windows after the read).
        fresh_read, compiled = self.split_read, False
        for i, (event, phase) in enumerate(w.events):
            site = self.sites.get(key := self._site_key(event, phase))
            if site is None:
                site = self.sites[key] = Site(late=steady)
            if event.kind == "compile":
                ctx = Context(w, reads, self.loaders, site.runs, label, self.hlo, self.is_internal,
                              self._recent_recompile(index), self.library_of)
                graph = self._new_graph(event, phase, site, label, index, next(times, None), ctx,
                                        w.hlo.get(i), fresh_read, dynamo)
                compiled |= graph is not None
                if graph is not None and graph.trigger == "host access" and not in_closure(event):
                    fresh = reads.get(graph.where)
                    fresh_read = (graph.where, read_cause(fresh.kind if fresh is not None else None),
                                  fresh.library if fresh is not None else graph.library)
                if graph is not None and graph.kind == "recompile":
                    found.append(graph)
            else:
                self._executed(event, site, label)
        for _ in range(w.unlogged_compiles):
            graph = self._unlogged_graph(w, label, index, next(times, None))
            if graph.kind == "recompile":
                found.append(graph)
        self.split_read = fresh_read if compiled and self.executions_logged else None
        line = next((user_frames(e.frames, self.is_internal)[0].where for e, _ in w.events if e.frames), "") \
            if w.fallbacks else ""
        self.host.observe(w, reads, label, index, steady, self.optimizer_step, line)
        return found

    def _site_key(self, event: XlaEvent, phase: str) -> tuple:
        """The whole stack, library frames included: torch_xla.compile's two syncs, a rendezvous's
        two exchanges, a loader's sync are apart even when the user's line is the same."""
        return (phase, *(f.where for f in event.frames))

    def _executed(self, event: XlaEvent, site: Site, step: int | None) -> None:
        graph = event.graph_hash
        self.executions[graph] = self.executions.get(graph, 0) + 1
        home = self.home.setdefault(graph, site)
        if self.executions[graph] > 1:
            self._warm(home)  # its graph ran again, wherever the sync that flushed it was
        repeat = graph in site.seen
        site.seen.add(graph)
        if graph not in site.graphs:
            site.graphs.append(graph)  # compiled before this watch began, or at another site
        if repeat or len(site.seen) >= WARMUP_GRAPHS:
            self._warm(site)
        site.last = graph
        site.runs.append((step, graph))
        del site.runs[:-RUNS_KEPT]

    def _warm(self, site: Site) -> None:
        if not site.warm:
            site.warm = True
            self.warm_sites += 1

    def _recent_recompile(self, index: int) -> tuple[Graph, list[str]] | None:
        if self.last_recompile is None or index - self.last_recompile[0] > 1:
            return None
        return self.last_recompile[1], self.last_recompile[2]

    def _kind(self, site: Site, index: int, w: Window) -> str:
        if not self.executions_logged:
            return "warmup" if index <= self.warmup_steps else "recompile" if site.graphs else "late"
        optimizer_warmup = any(n <= OPTIMIZER_WARMUP_STEPS for n in w.optimizer_steps)
        if index <= self.warmup_steps or optimizer_warmup or not site.warm:
            return "late" if site.late else "warmup"
        return "recompile"

    def _new_graph(self, event: XlaEvent, phase: str, site: Site, step: int | None, index: int, seconds: float | None,
                   ctx: Context, hlo: hlo_diff.HloSummary | None, fresh_read: tuple[str, str, str] | None,
                   dynamo: Sequence[DynamoEntry] = ()) -> Graph | None:
        self.uses_log = True
        self.last_new_graph = index
        if event.graph_hash in self.graphs:
            return None  # compiled again (cache eviction): not a new graph
        frames = [f.where for f in user_frames(event.frames, self.is_internal)]
        if event.dynamo and ctx.window.compiled_at and all(map(self.is_internal, (f.file for f in event.frames))):
            frames = [ctx.window.compiled_at]  # the log's few frames end inside torch: the user's compiled call
        kind = self._kind(site, index, ctx.window)
        if kind in ("warmup", "late") and self.executions_logged and index > self.warmup_steps and site.last \
                and (grown(self.hlo.get(site.last), hlo) is not None or kind == "warmup" and slice_made(
                    self.hlo.get(site.last), hlo, self.is_internal, self.loaders, ctx.window, ctx.follows)):
            kind = "recompile"  # a slice's new length, a tensor grown again: never warm-up, every shape counts
        growth = self._growth(site, index, step, hlo)
        kind = "recompile" if growth else kind
        graph = Graph(hash=event.graph_hash, phase=phase, step=step, compile_time_s=seconds,
                      kind=kind, cause=WARMUP, detail="", after_steps=index - 1,
                      where=frames[0] if frames else "", trigger=_trigger(event), site=frames,
                      inputs=event.inputs, outputs=event.outputs,
                      library=library_frame(event.frames, self.is_internal, self.library_of))
        if growth:
            graph.cause, graph.detail = GROWING_GRAPH, growth
            graph.where, graph.library = self.optimizer_where or graph.where, ""
        elif (graph.kind == "recompile" and fresh_read is not None
              and not not_the_read(self.hlo.get(site.last), hlo, ctx)):
            # The read ran part of the step first: the step's graph lost that part. One cause, one report.
            graph.kind, (graph.where, graph.cause, library) = "late", fresh_read
            read = ctx.reads.get(graph.where)
            graph.library = read.library if read is not None else library or graph.library
            graph.fix = fix_for(graph.cause, graph.library, read is not None and read.padded,
                                read.function if read is not None else "")
            graph.detail = f"the step's graph changed because the read at {short(graph.where)} ran part of it first"
        elif graph.kind == "recompile" and dynamo:
            _dynamo_cause(graph, dynamo[0], ctx)  # dynamo recompiled: its guard says why
            self.last_recompile = (index, graph, hlo.outputs if hlo is not None else [])
        elif graph.kind == "recompile" and ctx.follows and ctx.follows[0].detail.startswith("dynamo recompiled"):
            first = ctx.follows[0]  # the next graph of the same dynamo recompilation: one bug, one line
            graph.cause, graph.where, graph.library, graph.fix = first.cause, first.where, first.library, first.fix
            graph.detail = f"the same recompilation as graph {first.hash[:12]} at step {first.step}: {first.detail}"
        elif graph.kind == "recompile":
            graph.cause, graph.detail, graph.where, graph.library = explain(
                self.hlo.get(site.last), hlo, graph.where, ctx, graph.library)
            graph.fix = fix_of(graph, ctx)  # the moved scalar's, the fallback op's; "" for the cause's own
            self.last_recompile = (index, graph, hlo.outputs if hlo is not None else [])
        elif graph.kind == "late":
            # Only a graph a read ran is the read's: a sync's graph keeps its own library line, though
            # the user's line (`trainer.train()`) may have read a value through another library line.
            read = ctx.reads.get(graph.where) if event.host_access else None
            graph.cause = read_cause(read.kind if read is not None else None) if event.host_access else NEW_CALL_SITE
            graph.library = (read.library if read is not None else "") or graph.library
            graph.fix = fix_for(graph.cause, graph.library, read.padded, read.function) if read is not None else ""
        if graph.kind != "warmup" and not growth and not event.host_access:
            # The Trainer's shorter last window is its setting, not the sync; else a graph at a new call site
            # may be a ragged last batch synced there: then it is a recompilation, the latest one.
            remainder = accumulation_remainder(graph, ctx)
            if not remainder and graph.cause == NEW_CALL_SITE and ragged_batch(graph, hlo, ctx):
                self.last_recompile = (index, graph, hlo.outputs if hlo is not None else [])
        if graph.kind != "warmup" and not graph.fix:  # a dynamo recompilation's is set: the compiled library's
            graph.fix = fix_for(graph.cause, graph.library)
        if hlo is not None:
            self.hlo[event.graph_hash] = hlo
        self.home.setdefault(event.graph_hash, site)
        site.graphs.append(event.graph_hash)
        self.graphs[event.graph_hash] = graph
        return graph

    def _growth(self, site: Site, index: int, step: int | None, hlo: hlo_diff.HloSummary | None) -> str:
        """What shows a call site's graph growing step over step (a loop that never syncs: each step's
        graph holds every step before it), or "". Three graphs in three consecutive steps, each larger
        than the last by about a whole step (nine tenths of the site's first graph, at least), and by
        about as much each time, a step's ops again: the least growth at least half the most (a first
        optimizer step differs from later ones: timm's train.py grew by 729, then 854 ops). A warm-up
        does not grow so: ZeRO-1's tiny set-up graph, the first optimizer step's, then a steady step's
        (pytorch/xla's test_train_mp_mnist_zero1.py: 3, 663, 861 ops at one site, growth 660 then 198)."""
        if hlo is None:
            return ""
        site.sizes.append((index, step, len(hlo.instrs)))
        last = site.sizes[-GROWTH_STEPS:]
        if len(last) < GROWTH_STEPS or any(b[0] != a[0] + 1 for a, b in zip(last, last[1:], strict=False)):
            return ""
        sizes = [n for _, _, n in last]
        grew = [b - a for a, b in zip(sizes, sizes[1:], strict=False)]
        if any(d < max(1, site.sizes[0][2] * 9 // 10) for d in grew) or min(grew) < max(grew) / 2:
            return ""
        ops = ", ".join(f"{i}: {n}" for i, _, n in site.sizes[-6:])
        return (f"ops by step: {ops}; no sync ends the step, so each step's graph holds every step before "
                "it and is compiled again, longer every step")

    def _unlogged_graph(self, w: Window, step: int | None, index: int, seconds: float | None) -> Graph:
        site = self.sites.setdefault((w.phase,), Site(late=self._steady(index)))
        key = f"unlogged-{len(self.graphs) + 1}"
        kind = self._kind(site, index, w)
        if w.of(Refused):
            read = w.of(Refused)[0].read
            why = (f"no hash: torch_xla compiled it for the read at {short(read.where)} and then refused to "
                   "run it (torch_xla.compile(full_graph=True)), without logging it")
        elif w.eager:
            why = ("no hash: compiled by torch_xla's eager mode, which compiles and runs each op (or small "
                   "group of ops) as its own graph outside torch_xla.compile and writes no PT_XLA_DEBUG record "
                   "of it; precompile coverage is unknown for such a run")
        else:
            why = ("no hash: torch_xla counted this compile but wrote no PT_XLA_DEBUG record of it (the "
                   "process set up the checker after its first graph, or failed while compiling)")
        graph = Graph(hash="", phase=w.phase, step=step, compile_time_s=seconds, kind=kind,
                      cause=WARMUP if kind == "warmup" else UNKNOWN, detail=why, where="", trigger="",
                      site=[], inputs=-1, outputs=-1, after_steps=index - 1)
        site.graphs.append(key)
        self.graphs[key] = graph
        return graph

    def _dynamo_notes(self, w: Window, index: int, step: int | None) -> list[DynamoEntry]:
        """Record dynamo's notes; returns this window's recompilations past the warm-up (defects).

        Warm-up as on the lazy path: an optimizer's first steps (its state appears: the first guard
        failure of its compiled `step`), the first --warmup-steps steps and a phase's first window.
        A step here is a compiled call or a sync that ran a graph. Graph breaks are reported, never a
        defect.
        """
        # A phase's first window is its warm-up, as a new site is on the lazy path: the switch to
        # sifted steps or the first evaluation may recompile once (a graph break's resume function
        # guarded on the phase's flag), the next window of that phase may not.
        new_phase = w.phase not in self.phases
        self.phases.add(w.phase)
        warm = new_phase or index <= max(OPTIMIZER_WARMUP_STEPS, self.warmup_steps) or any(
            n <= OPTIMIZER_WARMUP_STEPS for n in w.optimizer_steps)
        found = []
        for note in w.of(DynamoNote):
            if note.kind == "graph_break":
                known = next((d for d in self.dynamo if d.kind == "graph_break"
                              and (d.where, d.reason) == (note.where, note.reason)), None)
                if known is not None:
                    known.count += 1
                    continue
                defect, cause = False, GRAPH_BREAK
            else:
                defect = note.kind == "limit" or not warm
                cause = DYNAMO_EAGER if note.kind == "limit" else DYNAMO_RECOMPILE
            entry = DynamoEntry(note.kind, note.function, note.reason, note.where, note.library, step, w.phase,
                                defect, 1, cause, fix_for(cause, _compiled_library(note.function)))
            if note.kind != "graph_break" and not self.scheduled:
                guarded_write(entry)  # the user's line that wrote the guarded value, when it is one
            self.dynamo.append(entry)
            if entry.defect and note.kind == "recompile":
                found.append(entry)
        return found

    def summary(self, max_graphs: int | None = None) -> GraphReport:
        graphs = [replace(g, executions=self.executions.get(g.hash, 0)) for g in self.graphs.values()]
        logging_steps = max((o.logging_steps for o in self.loaders.origins.values()), default=0)
        host, host_problems = self.host.report(self.steady_steps, self.steady_optimizer_steps, logging_steps)
        problems = (recompile_problems([g for g in graphs if g.kind == "recompile"])
                    + dynamo_problems(self.dynamo) + host_problems
                    + [error_problem(n.cause, short(n.where) if n.where else "an unknown line") for n in self.notes])
        if max_graphs is not None and len(graphs) > max_graphs:
            problems.append(f"{len(graphs)} distinct graphs compiled, more than --max-graphs {max_graphs}")
        return GraphReport(warmup_steps=self.warmup_steps, steps=self.steps, graphs=graphs, host_syncs=host,
                           fallback_ops=self.host.fallback, dynamo=self.dynamo, problems=problems,
                           source="pt_xla_debug" if self.uses_log or not graphs else "counters",
                           scalar_reads_after_warmup=self.host.scalar_reads, errors=list(self.notes))

    def tracing_lines_wanted(self, lines_after_new_graph: int) -> bool:
        """Python lines on traced ops (IR debug) cost tracing time: wanted while graphs change."""
        recent = self.last_new_graph and self.steps - self.last_new_graph < lines_after_new_graph
        return not self.steady or bool(recent)


def _compiled_library(function: str) -> str:
    """`torch/optim/sgd.py` out of `step (torch/optim/sgd.py:105)`: the library of the compiled function."""
    return function.partition("(")[2].rpartition(":")[0]


def _dynamo_cause(graph: Graph, note: DynamoEntry, ctx: Context) -> None:
    """A new graph made by a dynamo recompilation: dynamo's failed guard is the cause; a size guard
    is a new input shape, named at the loader whose last batch had it when there is one."""
    note.graph = graph.hash
    graph.detail = f"dynamo recompiled {note.function}: {note.reason}"
    graph.where, graph.library = note.where or graph.where, note.library
    graph.cause = NEW_INPUT_SHAPE if "size mismatch" in note.reason else DYNAMO_RECOMPILE
    if graph.cause == NEW_INPUT_SHAPE:
        origin = ctx.loaders.ragged_in(ctx.window)
        # ragged_in names only a loader with a ragged last batch: its size and length are known.
        if origin is not None and origin.samples is not None and origin.batch_size is not None:
            graph.where, graph.library = origin.where, origin.library
            graph.detail += (f"; the batches come from the DataLoader at {short(origin.where)} (batch_size "
                             f"{origin.batch_size}, drop_last=False, {origin.samples} samples: each pass "
                             f"ends with a batch of {origin.samples % origin.batch_size})")
    graph.fix = note.fix if note.detail else fix_for(graph.cause, graph.library or _compiled_library(note.function))


def _trigger(event: XlaEvent) -> str:
    return "host access" if event.host_access else "dynamo" if event.dynamo else "sync"
