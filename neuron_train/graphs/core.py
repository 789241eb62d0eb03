"""Graph stability: which graphs a run compiles, at which step, why, and from which line.

Sources, all from torch_xla itself:
- `PT_XLA_DEBUG_LEVEL` analysis blocks (graph_log.py): one per compile (level 1) and per graph
  execution (level 2), with the graph hash, the cause (a sync, or a host read before the sync) and
  the Python frames. The hash is the compile-cache key: stable across processes.
- XLA's HLO dump of each compiled graph (hlo_diff.py): what changed when a call site compiles again.
- Counters: `UncachedCompile`, `CompileTime`, `aten::*` CPU fallbacks, `aten::_local_scalar_dense`.
- Hooks (graph_hooks.py): step boundaries, host reads of tensor values, optimizer scalars 0/1.

A *call site* is the user's stack that ran a graph (the step's sync, an eval loop's sync, a line
that read a value). After the warm-up, a second graph at a known call site is a *recompilation*; the
first graph of a new call site (the first evaluation) is a *late graph* that precompile must cover.

torch_xla reads PT_XLA_DEBUG_* at its first compile or execution and XLA reads XLA_FLAGS when the
device client starts: `prepare_process()` must run before either (neuron-train train and
check-graphs do). Set later, the watch still counts compiles, without hashes, causes or lines.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from neuron_train.common.errors import RunError
from neuron_train.graphs import hlo_diff
from neuron_train.graphs import hooks as graph_hooks
from neuron_train.graphs.log import Frame, XlaEvent, internal_file_predicate, parse_debug_log, user_frames

ENV_DIR = "NEURON_TRAIN_GRAPHS_DIR"          # set by check-graphs: every process writes here
ENV_WARMUP = "NEURON_TRAIN_GRAPHS_WARMUP"    # check-graphs --warmup-steps
ENV_XLA_FLAGS = "NEURON_TRAIN_GRAPHS_XLA_FLAGS"  # XLA_FLAGS as the user set them, before our dump
RECORD_PREFIX = "record."                    # <dir>/record.<pid>.json: one process's summary

WARMUP = "warm-up"
NEW_CALL_SITE = "new call site"
HOST_ACCESS = "host access before sync"
VALUE_BRANCH = "value-dependent control flow"
DATA_DEPENDENT = "data-dependent shape"
HOST_READ = "host read after the sync"       # a copy that waits for the device; no extra graph
NEW_INPUT_SHAPE = hlo_diff.NEW_INPUT_SHAPE
NEW_CONSTANT = hlo_diff.NEW_CONSTANT
GRAPH_STRUCTURE = hlo_diff.GRAPH_STRUCTURE
UNKNOWN = hlo_diff.UNKNOWN

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
    UNKNOWN: "run `neuron-train check-graphs -- COMMAND` for the cause",
}

# Host reads recorded by the hooks: kind -> how the report names it.
HOST_READS = {"item": ".item()", "bool": "Python if/bool() on a tensor", "print": "printing a tensor",
              "tolist": ".tolist()", "cpu": ".cpu()", "numpy": ".numpy()", "float": "float()",
              "int": "int()", "value": "a tensor value read", "fallback": "a CPU fallback op"}
_READ_CAUSES = {"bool": VALUE_BRANCH, "fallback": DATA_DEPENDENT}
SCALAR_READ = "aten::_local_scalar_dense"  # a host read of one value, counted like a fallback op
LINES_AFTER_NEW_GRAPH = 3  # steps traced with Python lines after a graph compiled past the warm-up


# ----- process set-up -------------------------------------------------------------------------
@dataclass
class DebugFiles:
    log: Path                 # PT_XLA_DEBUG_FILE
    hlo_dir: Path | None      # XLA's --xla_dump_to, when ours
    start: int = 0            # log bytes that were there before us


_FILES: DebugFiles | None = None


def prepare_process(check: bool = True) -> DebugFiles:
    """Point torch_xla's graph analysis at files this process reads; call before any XLA work.

    `check=False` (the cheap mode every training run uses) logs compiles only; `check=True` also
    logs every graph execution (host reads before the sync) and dumps each new graph's HLO.
    """
    global _FILES
    if _FILES is not None:
        return _FILES
    shared = os.environ.get(ENV_DIR)
    if shared:
        base = Path(shared)
    else:
        base = Path(tempfile.mkdtemp(prefix="neuron-train-graphs-"))
        atexit.register(shutil.rmtree, base, True)
    pid = os.getpid()
    user_log = None if shared else os.environ.get("PT_XLA_DEBUG_FILE")
    log = Path(user_log) if user_log else base / f"xla-debug.{pid}.log"
    os.environ["PT_XLA_DEBUG_FILE"] = str(log)
    if shared or "PT_XLA_DEBUG_LEVEL" not in os.environ:
        os.environ["PT_XLA_DEBUG_LEVEL"] = "2" if check else "1"
    os.environ.setdefault("PT_XLA_DEBUG_MAX_FRAME", "100")  # torch.compile stacks are deep
    hlo_dir = None
    if check:
        flags = os.environ.setdefault(ENV_XLA_FLAGS, os.environ.get("XLA_FLAGS", ""))
        if "--xla_dump_to" not in flags:  # the user's own dump wins; we then skip the HLO diff
            hlo_dir = base / f"hlo.{pid}"
            os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={hlo_dir}".strip()
    _FILES = DebugFiles(log, hlo_dir, log.stat().st_size if log.exists() else 0)
    return _FILES


def internal_predicate() -> Callable[[str], bool]:
    """Files that are not the user's: libraries, the standard library, this instrumentation."""
    import torch
    import torch_xla

    paths = sysconfig.get_paths()
    libs = {paths["stdlib"], paths["purelib"], paths["platlib"],
            os.path.dirname(torch.__file__), os.path.dirname(torch_xla.__file__)}
    here = os.path.dirname(os.path.abspath(__file__))  # neuron_train/graphs: the instrumentation
    package = os.path.dirname(here)                    # the rest of neuron_train is user code
    return internal_file_predicate(tuple(sorted(libs)), keep=(package + os.sep,), always=(here + os.sep,))


# ----- what one step window holds -------------------------------------------------------------
@dataclass
class HostRead:
    kind: str        # a HOST_READS key
    where: str       # the innermost user line
    phase: str


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
    scalars: list[dict]                       # optimizer scalars that became / stopped being 0 or 1
    phase: str


# ----- classification -------------------------------------------------------------------------
@dataclass
class Analyzer:
    """Turns step windows into graphs, recompilations, late graphs and host syncs (pure Python)."""

    warmup_steps: int
    is_internal: Callable[[str], bool]
    steps: int = 0
    steady_steps: int = 0
    last_step: int | None = None
    graphs: dict[str, dict] = field(default_factory=dict)
    hlo: dict[str, hlo_diff.HloSummary] = field(default_factory=dict)  # graph hash -> its HLO
    sites: dict[tuple, list[str]] = field(default_factory=dict)
    last_at_site: dict[tuple, str] = field(default_factory=dict)
    executions: dict[str, int] = field(default_factory=dict)
    host: dict[str, dict] = field(default_factory=dict)
    fallback: dict[str, dict] = field(default_factory=dict)
    scalar_reads: int = 0
    uses_log: bool = False
    last_new_graph: int = 0   # the step index of the latest graph compiled after the warm-up

    def observe(self, w: Window) -> list[dict]:
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
                if graph and graph["kind"] != "warmup":
                    self.last_new_graph = index
                if graph and graph["kind"] == "recompile":
                    found.append(graph)
            else:
                self.executions[event.graph_hash] = self.executions.get(event.graph_hash, 0) + 1
                self.last_at_site[site] = event.graph_hash
                known = self.sites.setdefault(site, [])
                if event.graph_hash not in self.graphs and event.graph_hash not in known:
                    known.append(event.graph_hash)  # compiled before this watch began, here
        for _ in range(w.unlogged_compiles):
            graph = self._unlogged_graph(w.phase, label, steady, next(times, None))
            if graph["kind"] == "recompile":
                found.append(graph)
        if steady:
            self._host_syncs(w, reads, label, index)
        self._fallbacks(w, reads, label)
        return found

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
                   seconds: float | None, w: Window, reads: dict, hlo) -> dict | None:
        self.uses_log = True
        if event.graph_hash in self.graphs:
            return None  # compiled again (cache eviction): not a new graph
        where = site[1] if len(site) > 1 else ""
        prior = self.sites.get(site, [])
        kind = "warmup" if not steady else ("recompile" if prior else "late")
        graph = {"hash": event.graph_hash, "phase": phase, "step": step, "compile_time_s": seconds,
                 "kind": kind, "cause": WARMUP, "detail": "", "where": where,
                 "trigger": _trigger(event), "site": list(site[1:]),
                 "inputs": event.inputs, "outputs": event.outputs}
        if kind == "late":
            graph["cause"] = self._access_cause(where, reads) if event.host_access else NEW_CALL_SITE
        elif kind == "recompile":
            base = self.hlo.get(self.last_at_site.get(site, prior[-1]))
            graph.update(self._explain(base, hlo, where, event, w, reads))
        if hlo is not None:
            self.hlo[event.graph_hash] = hlo
        self.sites.setdefault(site, []).append(event.graph_hash)
        self.graphs[event.graph_hash] = graph
        return graph

    def _access_cause(self, where: str, reads: dict) -> str:
        return _READ_CAUSES.get(reads.get(where, {}).get("kind"), HOST_ACCESS)

    def _explain(self, base, hlo, where: str, event: XlaEvent, w: Window, reads: dict) -> dict:
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
        return {"cause": cause, "detail": detail, "where": line}

    def _unlogged_graph(self, phase: str, step, steady: bool, seconds: float | None) -> dict:
        site = (phase,)
        key = f"unlogged-{len(self.graphs) + 1}"
        kind = "warmup" if not steady else ("recompile" if self.sites.get(site) else "late")
        graph = {"hash": "", "phase": phase, "step": step, "compile_time_s": seconds, "kind": kind,
                 "cause": WARMUP if kind == "warmup" else UNKNOWN,
                 "detail": "" if kind == "warmup" else "compiled without a PT_XLA_DEBUG record in this "
                 "process (prepare_process() ran after its first XLA graph)",
                 "where": "", "trigger": "", "site": [], "inputs": -1, "outputs": -1}
        self.sites.setdefault(site, []).append(key)
        self.graphs[key] = graph
        return graph

    def _host_syncs(self, w: Window, reads: dict, step, index: int) -> None:
        for where, read in reads.items():
            entry = self.host.setdefault(where, {"where": where, "kind": read["kind"],
                                                 "what": HOST_READS[read["kind"]],
                                                 "cause": _READ_CAUSES.get(read["kind"], HOST_ACCESS),
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
        graphs = [dict(g, executions=self.executions.get(g["hash"], 0)) for g in self.graphs.values()]
        host = [self._host_entry(e) for e in self.host.values()]
        recompiles = [g for g in graphs if g["kind"] == "recompile"]
        late = [g for g in graphs if g["kind"] == "late"]
        problems = [f"recompilation at step {g['step']} ({g['phase']}): {g['cause']} at {_short(g['where'])}"
                    for g in recompiles]
        problems += [f"{h['cause']}: {h['what']} at {_short(h['where'])} runs a graph before the step's sync in "
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


# ----- one process's recorder -----------------------------------------------------------------
class Recorder:
    """Collects one process's step windows from the log, the HLO dump, the counters and the hooks."""

    def __init__(self, files: DebugFiles, warmup_steps: int, phase: str = "main"):
        import torch_xla

        self._xlac = torch_xla._XLAC
        self.files = files
        self.analyzer = Analyzer(warmup_steps, internal_predicate(), hlo=_HLO)
        self.current_phase = phase
        self._window_phase = phase
        self._marks: list[tuple[int, str]] = []
        self._offset = max(files.start, self.log_size())  # what ran before this recorder is not ours
        self._log = None
        self._reads: list[HostRead] = []
        self._scalars: list[dict] = []
        self._compiles = self._counter("UncachedCompile")
        self._compile_ns0 = self._compile_ns()
        self._compiles0 = self._compiles
        self._fallback_counts = self._fallback_counters()
        self.lines = False          # graph_hooks.install: trace ops with their Python line
        self.loop_steps = False     # True once a GraphWatch numbers the steps
        self.sync_steps = 0         # syncs that ran a graph (the step count of a foreign script)
        self._lock = threading.RLock()

    def take_over_steps(self) -> None:
        """Our loop numbers the steps from now on; syncs before it (set-up) were not steps."""
        with self._lock:
            if not self.loop_steps:
                self.loop_steps = True
                self.analyzer.steps = 0
                self.phase("train")

    # -- inputs from the hooks and the loop --
    def phase(self, name: str) -> None:
        with self._lock:
            self._marks.append((self.log_size(), name))
            self.current_phase = name

    def note_read(self, kind: str, where: str) -> None:
        with self._lock:
            self._reads.append(HostRead(kind, where, self.current_phase))

    def note_scalar(self, change: dict) -> None:
        with self._lock:
            self._scalars.append(change)

    def log_size(self) -> int:
        try:
            return os.stat(self.files.log).st_size
        except FileNotFoundError:
            return 0

    def step_end(self, step: int | None, is_step: bool = True) -> list[dict]:
        with self._lock:
            found = self.analyzer.observe(self._window(step, is_step))
            if self.lines:
                # Python lines on every traced op cost ~20% of tracing time: pay it while graphs
                # change (the warm-up, and a few steps after any later new graph), not in a stable run.
                a = self.analyzer
                changing = a.last_new_graph and a.steps - a.last_new_graph < LINES_AFTER_NEW_GRAPH
                self._xlac._set_ir_debug(a.steps < a.warmup_steps or bool(changing))
            return found

    def summary(self, max_graphs: int | None = None) -> dict:
        """Everything so far (events after the last step end count as a trailing window)."""
        with self._lock:
            self.analyzer.observe(self._window(None, False))
            out = self.analyzer.summary(max_graphs)
            out["compile_count"] = self._compiles - self._compiles0
            out["compile_time_s"] = (self._compile_ns() - self._compile_ns0) / 1e9
            return out

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    # -- reading the sources --
    def _window(self, step: int | None, is_step: bool) -> Window:
        events = self._read_events()
        compiles = self._counter("UncachedCompile")
        new = compiles - self._compiles
        self._compiles = compiles
        logged = [i for i, (e, _) in enumerate(events) if e.kind == "compile"]
        hlo = {i: s for i in logged if (s := compiled_hlo(self.files.hlo_dir, events[i][0])) is not None}
        fallbacks, scalar_reads = self._fallback_delta()
        reads, self._reads = self._reads, []
        scalars, self._scalars = self._scalars, []
        return Window(step=step, is_step=is_step, events=events,
                      unlogged_compiles=max(0, new - len(logged)), compile_times=self._compile_times(new),
                      hlo=hlo, reads=reads, fallbacks=fallbacks, scalar_reads=scalar_reads,
                      scalars=scalars, phase=self.current_phase)

    def _read_events(self) -> list[tuple[XlaEvent, str]]:
        if self._log is None:
            try:
                self._log = open(self.files.log, "rb")  # kept open: read a little every step
            except FileNotFoundError:
                return []
        self._log.seek(self._offset)
        # latin-1 maps each byte to one character, so text offsets are file offsets
        text = self._log.read().decode("latin-1")
        events, used = parse_debug_log(text)
        start = self._offset
        self._offset += used
        out = []
        phase = self._window_phase
        for event in events:
            while self._marks and self._marks[0][0] <= start + event.offset:
                phase = self._marks.pop(0)[1]
            event.frames = [_utf8(frame) for frame in event.frames]
            out.append((event, phase))
        while self._marks and self._marks[0][0] <= self._offset:
            phase = self._marks.pop(0)[1]
        self._window_phase = phase
        return out

    def _counter(self, name: str) -> int:
        return self._xlac._xla_counter_value(name) or 0

    def _compile_ns(self) -> int:
        data = self._xlac._xla_metric_data("CompileTime")
        return int(data[1]) if data else 0

    def _compile_times(self, new: int) -> list[float | None]:
        if new <= 0:
            return []
        data = self._xlac._xla_metric_data("CompileTime")
        samples = list(data[2])[-new:] if data else []
        return [v / 1e9 for _, v in samples] + [None] * (new - len(samples))

    def _fallback_counters(self) -> dict[str, int]:
        return {op: self._counter(op) for op in self._xlac._get_executed_fallback_ops()}

    def _fallback_delta(self) -> tuple[dict[str, int], int]:
        now = self._fallback_counters()
        delta = {op: n - self._fallback_counts.get(op, 0) for op, n in now.items()}
        self._fallback_counts = now
        scalar = delta.pop(SCALAR_READ, 0)
        return {op: n for op, n in delta.items() if n > 0}, scalar


_HLO: dict[str, hlo_diff.HloSummary] = {}  # graph hash -> its HLO, for every watch in the process
_HLO_READ: set[str] = set()
_HLO_LOCK = threading.Lock()


def compiled_hlo(folder: Path | None, event: XlaEvent) -> hlo_diff.HloSummary | None:
    """The dumped HLO of a compile: the oldest unread module whose inputs match the event's.

    XLA numbers the modules in compile order; the files are read once (and deleted: the CPU backend
    dumps much more than we need), so graphs are kept by hash for every watch in this process.
    """
    with _HLO_LOCK:
        if event.graph_hash in _HLO:
            return _HLO[event.graph_hash]
        if folder is None or not folder.is_dir():
            return None
        for path in sorted(folder.glob("module_*.before_optimizations.txt")):
            if path.name in _HLO_READ:
                continue
            _HLO_READ.add(path.name)
            summary = hlo_diff.summarize_hlo(path.read_text(errors="replace"))
            for other in folder.glob(path.name.split(".", 1)[0] + ".*"):
                other.unlink(missing_ok=True)
            if len(summary.params) == event.inputs:
                _HLO[event.graph_hash] = summary
                return summary
        return None


def _trigger(event: XlaEvent) -> str:
    return "host access" if event.host_access else "dynamo" if event.dynamo else "sync"


def _utf8(frame: Frame) -> Frame:
    """Undo the latin-1 reading for file names that are not ASCII."""
    if frame.file.isascii():
        return frame
    return Frame(frame.function, frame.file.encode("latin-1").decode("utf-8", "replace"), frame.line)


_RECORDER: Recorder | None = None


def process_recorder(warmup_steps: int, check: bool) -> Recorder:
    """This process's recorder: created by check-graphs' instrumentation or by the first watch."""
    global _RECORDER
    if _RECORDER is None:
        files = prepare_process(check)
        _RECORDER = Recorder(files, warmup_steps, phase="train")
        if check:
            graph_hooks.install(_RECORDER)
    return _RECORDER


def start_instrumented_process() -> Recorder:
    """check-graphs' entry in each process, right after torch_xla is imported."""
    global _RECORDER
    files = prepare_process(check=True)
    _RECORDER = Recorder(files, int(os.environ.get(ENV_WARMUP, "2")), phase="main")
    graph_hooks.install(_RECORDER, count_syncs=True)
    atexit.register(write_record, _RECORDER, Path(os.environ[ENV_DIR]))
    return _RECORDER


def write_record(recorder: Recorder, folder: Path) -> None:
    """One process's summary for check-graphs to merge (atomic: temp file + rename)."""
    record = {"pid": os.getpid(), "argv": sys.argv, "rank": os.environ.get("RANK"),
              "local_rank": os.environ.get("LOCAL_RANK"), **recorder.summary()}
    path = folder / f"{RECORD_PREFIX}{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, default=str))
    os.replace(tmp, path)


def arm_process() -> None:
    """check-graphs, at interpreter start: set torch_xla's debug variables now, hook in on import."""
    prepare_process(check=True)
    if "torch_xla" in sys.modules:
        start_instrumented_process()
    else:
        sys.meta_path.insert(0, graph_hooks.AfterImport("torch_xla", lambda _: start_instrumented_process()))



# ----- the in-process API ---------------------------------------------------------------------
class GraphWatch:
    """What our training loop calls: phases, step ends, and a summary of the graphs it compiled."""

    def __init__(self, warmup_steps: int, fail_on_recompile: bool = False):
        if warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        self.fail_on_recompile = fail_on_recompile
        self._rec = process_recorder(warmup_steps, check=fail_on_recompile)
        self._rec.take_over_steps()  # the loop's optimizer steps, not every sync, are the steps

    def phase(self, name: str) -> None:
        """Label graphs compiled from now on ('train', 'eval', 'checkpoint', ...)."""
        self._rec.phase(name)

    def step_end(self, step: int) -> None:
        """Call right after each optimizer step's sync, on the main thread."""
        found = self._rec.step_end(step)
        if found and self.fail_on_recompile:
            raise RunError(describe_recompile(found[0]))

    def summary(self) -> dict:
        return self._rec.summary()


def describe_recompile(graph: dict) -> str:
    return (f"recompilation after warm-up at step {graph['step']} ({graph['phase']}): {graph['cause']} "
            f"at {graph['where'] or 'an unknown line'}" + (f" [{graph['detail']}]" if graph["detail"] else "")
            + f"; fix: {FIXES.get(graph['cause'], FIXES[UNKNOWN])}")


def assert_graph_stable(step_fn: Callable[..., object], steps: int = 8, warmup: int = 2,
                        max_graphs: int | None = None) -> dict:
    """Run `step_fn(step)` `steps` times, syncing after each, and fail unless the graphs settle.

    For pytest: `assert_graph_stable(lambda i: train_step(batches[i]), steps=6)`. Raises
    AssertionError with the report when a graph is compiled after `warmup` steps, a host read runs
    a graph before the sync every step, or more than `max_graphs` graphs are compiled. For causes and
    lines, call `prepare_process()` before any XLA work (e.g. at the top of conftest.py).
    """
    import torch_xla

    if steps <= warmup:
        raise ValueError(f"steps ({steps}) must exceed warmup ({warmup}) to see the steady state")
    takes_step = bool(inspect.signature(step_fn).parameters)
    with _debug_env_kept():
        recorder = Recorder(prepare_process(check=True), warmup, phase="test")
        undo = graph_hooks.install(recorder)
        try:
            for i in range(steps):
                step_fn(i) if takes_step else step_fn()
                torch_xla.sync()
                recorder.step_end(i + 1)
        finally:
            undo()
    report = recorder.summary(max_graphs)
    recorder.close()
    if not report["stable"]:
        raise AssertionError("the step is not graph-stable:\n" + format_report(report))
    return report


@contextlib.contextmanager
def _debug_env_kept():
    """torch_xla has read the debug variables by the end of the run: keep them from leaking into
    processes the test suite starts later."""
    names = ("PT_XLA_DEBUG_FILE", "PT_XLA_DEBUG_LEVEL", "PT_XLA_DEBUG_MAX_FRAME", "XLA_FLAGS", ENV_XLA_FLAGS)
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ----- the text report ------------------------------------------------------------------------
def format_report(r: dict) -> str:
    lines = [f"graphs: {r['distinct_graphs']} distinct, {r.get('compile_count', '?')} compiles "
             f"({_seconds(r.get('compile_time_s'))}) over {r['steps']} steps, warm-up {r['warmup_steps']}"]
    for n, g in enumerate(r["graphs"], 1):
        lines.append(f"  #{n} {(g['hash'] or '?')[:12]:12}  step {str(g['step']):>5}  {g['phase']:10} "
                     f"{g['kind']:9}  {_seconds(g['compile_time_s']):>7}  {_short(g['site'][0] if g['site'] else '')}")
    lines.append(f"recompilations after warm-up: {len(r['recompiles'])}")
    for g in r["recompiles"]:
        site = g["site"][0] if g["site"] else ""
        compiled = f" (graph compiled at {_short(site)})" if site and site != g["where"] else ""
        lines += [f"  step {g['step']} ({g['phase']}): {g['cause']} at {_short(g['where']) or '?'}{compiled}",
                  *([f"    {g['detail']}"] if g["detail"] else []),
                  f"    fix: {FIXES.get(g['cause'], FIXES[UNKNOWN])}"]
    lines.append(f"late graphs (compiled once after warm-up; precompile must cover them): "
                 f"{len(r['late_graphs'])}")
    for g in r["late_graphs"]:
        lines.append(f"  step {g['step']} ({g['phase']}): {g['cause']} at {_short(g['where']) or '?'}")
    lines.append(f"host syncs after warm-up: {len(r['host_syncs'])}")
    for h in r["host_syncs"]:
        effect = (f"{h['cause']}: runs a graph before the step's sync" if h["executes_graph"]
                  else "waits for the device, no extra graph")
        often = "every step" if h["every_step"] else f"steps {', '.join(map(str, h['steps']))}"
        lines.append(f"  {_short(h['where'])}: {h['what']} x{h['count']} ({often}; {effect})")
    fallbacks = r["fallback_ops"]
    lines.append(f"CPU fallback ops: {len(fallbacks)}")
    for op, f in fallbacks.items():
        lines.append(f"  {op} x{f['count']} from step {f['first_step']}"
                     + (f" at {', '.join(map(_short, f['where']))}" if f["where"] else ""))
    verdict = "graph-stable" if r["stable"] else "NOT graph-stable"
    lines.append(f"verdict: {verdict}" + "".join(f"\n  - {p}" for p in r["problems"]))
    return "\n".join(lines)


def _short(where: str) -> str:
    """A path under the current folder, relative: easier to read, still clickable."""
    cwd = os.getcwd() + os.sep
    return where[len(cwd):] if where.startswith(cwd) else where


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f} s"
