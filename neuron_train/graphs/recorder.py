"""One process's recorder: reads the PT_XLA_DEBUG log, the HLO dump, the counters and the hooks' notes
into step windows for the analyzer; check-graphs' entry in each process it runs.

Sources, all from torch_xla itself:
- `PT_XLA_DEBUG_LEVEL` analysis blocks (log.py): one per compile (level 1) and per graph execution
  (level 2), with the graph hash, the cause (a sync, or a host read before the sync) and the
  Python frames. The hash is the compile-cache key: stable across processes.
- XLA's HLO dump of each compiled graph (hlo_diff.py): what changed when a call site compiles again.
- Counters: `UncachedCompile`, `CompileTime`, `aten::*` CPU fallbacks, `aten::_local_scalar_dense`.
- Hooks (hooks.py): step boundaries, host reads of tensor values, optimizer scalars 0/1.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

from neuron_train.graphs import hlo_diff, hooks
from neuron_train.graphs.analyzer import Analyzer
from neuron_train.graphs.log import Frame, XlaEvent, parse_debug_log
from neuron_train.graphs.process import (
    ENV_DIR,
    ENV_WARMUP,
    PARTIAL_PREFIX,
    RECORD_PREFIX,
    DebugFiles,
    internal_predicate,
    library_of,
    prepare_process,
    xla_counter,
    xla_metric,
)
from neuron_train.graphs.records import SCALAR_READ, Graph, GraphReport, HostRead, Refused, Window

RECORD_EVERY_S = 10.0      # during the run a record is rewritten after a new graph, or after this long
LINES_AFTER_NEW_GRAPH = 3  # steps traced with Python lines after a graph compiled past the warm-up


class Recorder:
    """Collects one process's step windows from the log, the HLO dump, the counters and the hooks."""

    def __init__(self, files: DebugFiles, warmup_steps: int, phase: str = "main"):
        import torch_xla

        self._xlac = torch_xla._XLAC
        self.files = files
        level = os.environ.get("PT_XLA_DEBUG_LEVEL", "")
        self.analyzer = Analyzer(warmup_steps, internal_predicate(), hlo=_HLO, library_of=library_of(),
                                 executions_logged=level.isdigit() and int(level) >= 2)
        self.current_phase = phase
        self._window_phase = phase
        self._marks: list[tuple[int, str]] = []
        self._offset = max(files.start, self.log_size())  # what ran before this recorder is not ours
        self._log: BinaryIO | None = None
        self._noted: list[object] = []  # the hooks' records since the last step end (Window.noted)
        self._compiles = xla_counter("UncachedCompile")
        self._compile_s0 = xla_metric("CompileTime")[1]
        self._compiles0 = self._compiles
        self._fallback_counts = self._fallback_counters()
        self.lines = False          # hooks.install: trace ops with their Python line
        self.loop_steps = False     # True once a GraphWatch numbers the steps
        self.sync_steps = 0         # syncs that ran a graph (the step count of a foreign script)
        self.syncs = 0              # syncs and compiled calls, ran a graph or not
        # a cause with an `error` -> the user's line that leads to it: the first torch.inference_mode()
        # entered, the last torch._dynamo.mark_dynamic called
        self.error_lines: dict[str, str] = {}
        self.compiled_at = ""       # the user's line of the last torch.compile'd call: dynamo's graphs
                                    # are logged with too few frames to reach it
        self.eager_mode = bool(self._xlac._get_use_eager_mode())  # hooks.install: ever turned on
        self._lock = threading.RLock()
        self.record_to: Path | None = None   # check-graphs' record folder: written during the run too
        self._written = time.monotonic()
        self._graphs_written = 0

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

    def note_read(self, kind: str, where: str, library: str = "", compiled: bool = False) -> HostRead:
        read = HostRead(kind, where, self.current_phase, library, compiled)
        self.note(read)
        return read

    def note_refused(self, kind: str, where: str, message: str) -> None:
        self.note(Refused(HostRead(kind, where, self.current_phase), message))

    def note(self, record: object) -> None:
        with self._lock:  # from MpDeviceLoader's thread too (a batch)
            self._noted.append(record)

    def log_size(self) -> int:
        try:
            return os.stat(self.files.log).st_size
        except FileNotFoundError:
            return 0

    def step_end(self, step: int | None, is_step: bool = True) -> list[Graph]:
        with self._lock:
            found = self.analyzer.observe(self._window(step, is_step))
            if self.record_to is not None and (len(self.analyzer.graphs) != self._graphs_written
                                               or time.monotonic() - self._written > RECORD_EVERY_S):
                # A process stopped in the middle of a long compile (a signal is handled only after
                # it) never reaches its exit: what it saw so far is on disk already.
                write_record(self, self.record_to, final=False)
            if self.lines:
                # Python lines on every traced op cost ~20% of tracing time: pay it while graphs
                # change (the warm-up, and a few steps after any later new graph), not in a stable run.
                self._xlac._set_ir_debug(self.analyzer.tracing_lines_wanted(LINES_AFTER_NEW_GRAPH))
            return found

    def summary(self, max_graphs: int | None = None, final: bool = True) -> GraphReport:
        """Everything so far (events after the last step end count as a trailing window, when `final`;
        otherwise the steps ended so far, the recorder unchanged)."""
        with self._lock:
            if final:
                self.analyzer.observe(self._window(None, False))
            return replace(self.analyzer.summary(max_graphs), compile_count=self._compiles - self._compiles0,
                           compile_time_s=xla_metric("CompileTime")[1] - self._compile_s0)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    # -- reading the sources --
    def _window(self, step: int | None, is_step: bool) -> Window:
        events = self._read_events()
        compiles = xla_counter("UncachedCompile")
        new = compiles - self._compiles
        self._compiles = compiles
        logged = [i for i, (e, _) in enumerate(events) if e.kind == "compile"]
        hlo = {i: s for i in logged if (s := compiled_hlo(self.files.hlo_dir, events[i][0])) is not None}
        fallbacks, scalar_reads = self._fallback_delta()
        noted, self._noted = self._noted, []
        return Window(step=step, is_step=is_step, events=events,
                      unlogged_compiles=max(0, new - len(logged)), compile_times=self._compile_times(new),
                      hlo=hlo, fallbacks=fallbacks, scalar_reads=scalar_reads, phase=self.current_phase,
                      noted=noted, eager=self.eager_mode, compiled_at=self.compiled_at)

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

    def _compile_times(self, new: int) -> list[float | None]:
        if new <= 0:
            return []
        data = self._xlac._xla_metric_data("CompileTime")
        samples = list(data[2])[-new:] if data else []
        return [v / 1e9 for _, v in samples] + [None] * (new - len(samples))

    def _fallback_counters(self) -> dict[str, int]:
        return {op: xla_counter(op) for op in self._xlac._get_executed_fallback_ops()}

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
            hooks.install(_RECORDER)
    return _RECORDER


def start_instrumented_process() -> Recorder:
    """check-graphs' entry in each process, right after torch_xla is imported."""
    global _RECORDER
    files = prepare_process(check=True)
    _RECORDER = Recorder(files, int(os.environ.get(ENV_WARMUP, "0")), phase="main")
    hooks.install(_RECORDER, count_syncs=True)
    _RECORDER.record_to = Path(os.environ[ENV_DIR])
    atexit.register(write_record, _RECORDER, _RECORDER.record_to)
    return _RECORDER


def write_record(recorder: Recorder, folder: Path, final: bool = True) -> None:
    """One process's summary for check-graphs to merge (atomic: temp file + rename); during the run
    (`final` False) the steps so far, replaced by the next one and by the one written at exit."""
    recorder._written, recorder._graphs_written = time.monotonic(), len(recorder.analyzer.graphs)
    summary = recorder.summary(final=final)
    if not final:  # read only if this process never writes its record at exit
        summary.problems.append(
            f"process {os.getpid()} ({' '.join(sys.argv)[:80]}) imported torch_xla but ended without writing its "
            f"record (os._exit, or killed by a signal, maybe in a long compile): this report has what it "
            f"recorded until step {recorder.analyzer.steps}")
    record = replace(summary, pid=os.getpid(), argv=sys.argv, rank=os.environ.get("RANK"),
                     local_rank=os.environ.get("LOCAL_RANK"),
                     input_shapes={h: [p.shape for p in hlo.params] for h, hlo in _HLO.items()})
    path = folder / f"{RECORD_PREFIX if final else PARTIAL_PREFIX}{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record.to_json(), default=str))
    os.replace(tmp, path)
    if final:
        (folder / f"{PARTIAL_PREFIX}{os.getpid()}.json").unlink(missing_ok=True)
