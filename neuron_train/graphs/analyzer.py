"""Classification, pure Python: step windows in, graphs, recompilations, late graphs and host syncs out.

A *call site* is the user's stack that ran a graph (the step's sync, an eval loop's sync, a line
that read a value). After the warm-up, a second graph at a known call site is a *recompilation*; the
first graph of a new call site (the first evaluation) is a *late graph* that precompile must cover.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from neuron_train.graphs import hlo_diff
from neuron_train.graphs.log import XlaEvent, user_frames
from neuron_train.graphs.records import (
    DATA_DEPENDENT,
    GRAPH_STRUCTURE,
    HOST_ACCESS,
    HOST_READ,
    HOST_READS,
    NEW_CALL_SITE,
    NEW_CONSTANT,
    NEW_INPUT_SHAPE,
    READ_CAUSES,
    UNKNOWN,
    WARMUP,
    Graph,
    Window,
)
from neuron_train.graphs.report import short


@dataclass
class Analyzer:
    """Turns step windows into graphs, recompilations, late graphs and host syncs."""

    warmup_steps: int
    is_internal: Callable[[str], bool]
    steps: int = 0
    steady_steps: int = 0
    last_step: int | None = None
    graphs: dict[str, Graph] = field(default_factory=dict)
    hlo: dict[str, hlo_diff.HloSummary] = field(default_factory=dict)  # graph hash -> its HLO
    sites: dict[tuple, list[str]] = field(default_factory=dict)
    last_at_site: dict[tuple, str] = field(default_factory=dict)
    executions: dict[str, int] = field(default_factory=dict)
    host: dict[str, dict] = field(default_factory=dict)
    fallback: dict[str, dict] = field(default_factory=dict)
    scalar_reads: int = 0
    uses_log: bool = False
    last_new_graph: int = 0   # the step index of the latest graph compiled after the warm-up

    def observe(self, w: Window) -> list[Graph]:
        """Record a window; returns the recompilations it revealed."""
        if w.is_step:
            self.steps += 1
            self.last_step = w.step
        index = self.steps if w.is_step else self.steps + 1
        steady = index > self.warmup_steps
        self.steady_steps += steady and w.is_step
        label = w.step if w.step is not None else self.last_step
        reads = self._reads_by_line(w)
        found = []
        times = iter(w.compile_times)
        for i, (event, phase) in enumerate(w.events):
            site = self._site(event, phase)
            if event.kind == "compile":
                graph = self._new_graph(event, phase, site, label, steady, next(times, None), w, reads,
                                        w.hlo.get(i))
                if graph and graph.kind != "warmup":
                    self.last_new_graph = index
                if graph and graph.kind == "recompile":
                    found.append(graph)
            else:
                self._executed(event, site)
        for _ in range(w.unlogged_compiles):
            graph = self._unlogged_graph(w.phase, label, steady, next(times, None))
            if graph.kind == "recompile":
                found.append(graph)
        if steady:
            self._host_syncs(w, reads, label, index)
        self._fallbacks(w, reads, label)
        return found

    def _executed(self, event: XlaEvent, site: tuple) -> None:
        self.executions[event.graph_hash] = self.executions.get(event.graph_hash, 0) + 1
        self.last_at_site[site] = event.graph_hash
        known = self.sites.setdefault(site, [])
        if event.graph_hash not in self.graphs and event.graph_hash not in known:
            known.append(event.graph_hash)  # compiled before this watch began, here

    def _site(self, event: XlaEvent, phase: str) -> tuple:
        return (phase, *(f.where for f in user_frames(event.frames, self.is_internal)))

    def _reads_by_line(self, w: Window) -> dict[str, dict]:
        """Host reads of this window by line: from the hooks and from the log's host-access runs."""
        lines: dict[str, dict] = {}
        for read in w.reads:
            entry = lines.setdefault(read.where, {"kind": read.kind, "hooked": 0, "runs": 0,
                                                  "phase": read.phase})
            entry["hooked"] += 1
        for event, phase in w.events:
            if event.kind == "execute" and event.host_access:
                where = user_frames(event.frames, self.is_internal)[0].where
                kind = "fallback" if w.fallbacks else "value"
                entry = lines.setdefault(where, {"kind": kind, "hooked": 0, "runs": 0, "phase": phase})
                entry["runs"] += 1
        return lines

    def _new_graph(self, event: XlaEvent, phase: str, site: tuple, step, steady: bool,
                   seconds: float | None, w: Window, reads: dict, hlo) -> Graph | None:
        self.uses_log = True
        if event.graph_hash in self.graphs:
            return None  # compiled again (cache eviction): not a new graph
        where = site[1] if len(site) > 1 else ""
        prior = self.sites.get(site, [])
        kind = "warmup" if not steady else ("recompile" if prior else "late")
        graph = Graph(hash=event.graph_hash, phase=phase, step=step, compile_time_s=seconds, kind=kind,
                      cause=WARMUP, detail="", where=where, trigger=_trigger(event), site=list(site[1:]),
                      inputs=event.inputs, outputs=event.outputs)
        if kind == "late":
            graph.cause = self._access_cause(where, reads) if event.host_access else NEW_CALL_SITE
        elif kind == "recompile":
            base = self.hlo.get(self.last_at_site.get(site, prior[-1]))
            graph.cause, graph.detail, graph.where = self._explain(base, hlo, where, event, w, reads)
        if hlo is not None:
            self.hlo[event.graph_hash] = hlo
        self.sites.setdefault(site, []).append(event.graph_hash)
        self.graphs[event.graph_hash] = graph
        return graph

    def _access_cause(self, where: str, reads: dict) -> str:
        return READ_CAUSES.get(reads.get(where, {}).get("kind"), HOST_ACCESS)

    def _explain(self, base, hlo, where: str, event: XlaEvent, w: Window,
                 reads: dict) -> tuple[str, str, str]:
        """(cause, detail, line) of a recompilation."""
        if base is not None and hlo is not None:
            why = hlo_diff.explain(base, hlo, self.is_internal)
        else:
            why = hlo_diff.Explanation(UNKNOWN, "no HLO dump of the two graphs to compare "
                                       "(run under `neuron-train check-graphs`)")
        cause, detail, line = why.cause, why.detail, why.where or where
        fallback_lines = [ln for ln, r in reads.items() if r["kind"] == "fallback"]
        if w.fallbacks and fallback_lines and cause in (NEW_INPUT_SHAPE, GRAPH_STRUCTURE, UNKNOWN):
            ops = ", ".join(sorted(w.fallbacks))
            cause, line = DATA_DEPENDENT, fallback_lines[0]
            detail = f"{ops} ran on the CPU and its result's shape reached the graph ({why.detail})"
        elif cause == NEW_CONSTANT and not why.where and w.scalars:
            change = w.scalars[0]
            line = change["where"] or line
            detail += f"; optimizer param_groups[{change['group']}]['{change['key']}'] = {change['value']}"
        elif cause == UNKNOWN and event.host_access:
            cause = self._access_cause(where, reads)
        return cause, detail, line

    def _unlogged_graph(self, phase: str, step, steady: bool, seconds: float | None) -> Graph:
        site = (phase,)
        key = f"unlogged-{len(self.graphs) + 1}"
        kind = "warmup" if not steady else ("recompile" if self.sites.get(site) else "late")
        graph = Graph(hash="", phase=phase, step=step, compile_time_s=seconds, kind=kind,
                      cause=WARMUP if kind == "warmup" else UNKNOWN,
                      detail="" if kind == "warmup" else "compiled without a PT_XLA_DEBUG record in this "
                      "process (prepare_process() ran after its first XLA graph)",
                      where="", trigger="", site=[], inputs=-1, outputs=-1)
        self.sites.setdefault(site, []).append(key)
        self.graphs[key] = graph
        return graph

    def _host_syncs(self, w: Window, reads: dict, step, index: int) -> None:
        for where, read in reads.items():
            entry = self.host.setdefault(where, {"where": where, "kind": read["kind"],
                                                 "what": HOST_READS[read["kind"]],
                                                 "cause": READ_CAUSES.get(read["kind"], HOST_ACCESS),
                                                 "phase": read["phase"],
                                                 "count": 0, "steps": [], "executes_graph": False,
                                                 "_windows": set()})
            entry["count"] += max(read["hooked"], read["runs"])
            entry["executes_graph"] |= read["runs"] > 0
            entry["_windows"].add(index)
            if len(entry["steps"]) < 10 and step not in entry["steps"]:
                entry["steps"].append(step)
        self.scalar_reads += w.scalar_reads

    def _fallbacks(self, w: Window, reads: dict, step) -> None:
        lines = [where for where, r in reads.items() if r["kind"] == "fallback"]
        for op, count in w.fallbacks.items():
            entry = self.fallback.setdefault(op, {"count": 0, "first_step": step, "where": []})
            entry["count"] += count
            for where in lines:
                if where not in entry["where"] and len(entry["where"]) < 5:
                    entry["where"].append(where)

    def summary(self, max_graphs: int | None = None) -> dict:
        graphs = [asdict(replace(g, executions=self.executions.get(g.hash, 0))) for g in self.graphs.values()]
        host = [self._host_entry(e) for e in self.host.values()]
        recompiles = [g for g in graphs if g["kind"] == "recompile"]
        late = [g for g in graphs if g["kind"] == "late"]
        problems = [f"recompilation at step {g['step']} ({g['phase']}): {g['cause']} at {short(g['where'])}"
                    for g in recompiles]
        problems += [f"{h['cause']}: {h['what']} at {short(h['where'])} runs a graph before the step's sync in "
                     f"{len(h['steps_seen'])} of {self.steady_steps} steps after warm-up"
                     for h in host if h["executes_graph"] and h["every_step"]]
        if max_graphs is not None and len(graphs) > max_graphs:
            problems.append(f"{len(graphs)} distinct graphs compiled, more than --max-graphs {max_graphs}")
        for h in host:
            del h["steps_seen"]
        return {"warmup_steps": self.warmup_steps, "steps": self.steps, "distinct_graphs": len(graphs),
                "graphs": graphs, "late_graphs": late, "recompiles": recompiles, "host_syncs": host,
                "scalar_reads_after_warmup": self.scalar_reads, "fallback_ops": self.fallback,
                "source": "pt_xla_debug" if self.uses_log or not graphs else "counters",
                "problems": problems, "stable": not problems}

    def _host_entry(self, entry: dict) -> dict:
        out = {k: v for k, v in entry.items() if k != "_windows"}
        out["steps_seen"] = entry["_windows"]
        if not entry["executes_graph"]:
            out["cause"] = HOST_READ
        # A read in most steady steps is part of the step itself, not an occasional log or eval.
        out["every_step"] = self.steady_steps > 0 and len(entry["_windows"]) * 2 >= self.steady_steps
        return out


def _trigger(event: XlaEvent) -> str:
    return "host access" if event.host_access else "dynamo" if event.dynamo else "sync"
