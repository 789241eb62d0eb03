"""Inside each Python process of a user's command: step times, batch sizes, and when to stop.

`neuron-train precompile -- CMD`, `check-graphs --compile-cache DIR -- CMD` and `bench -- CMD` run
the command with the start-up hook (_startup/sitecustomize.py, start.py) in every Python process;
right after torch_xla is imported it calls `arm` with the checker's recorder, or, for bench, with
none (the checker stays off so the measured steps carry no debug logging). It adds:

- a subscriber to graphs/syncs.py's `torch_xla.sync` wrapper (after the checker's): each sync that
  ran a graph (torch_xla's compile-cache counters moved) ends a *step window*, timed on return
  (after the step's closures) and labelled with its call site (the innermost user line above the
  sync) and its compiles;
- host-to-device copies (`Tensor.to`, and `_xla_tensors_from_aten` behind MpDeviceLoader): the
  shape of the largest one per window gives the samples per step;
- the stop (steps.py's rules): the tour's past the first epoch's end (epochs.py) or once every call
  site is warm and N steps have passed, bench's after N steady intervals; the process exits
  cleanly (SystemExit at the sync's return, so atexit writes every record);
- with --require-precompiled, a thread that reads torch_xla's compile log: torch_xla logs a
  graph's hash after lowering it and before the compiler runs, so a graph the manifest lacks stops
  the process while its compile has only started.

Everything is written to `probe.<pid>.json` next to the checker's `record.<pid>.json`.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from neuron_train.graphs import syncs
from neuron_train.graphs.process import internal_predicate, xla_counter, xla_metric
from neuron_train.instrument.epochs import EPOCH_ENV, Epochs, say
from neuron_train.instrument.proc import descendants
from neuron_train.instrument.steps import Sites, StepWindow

if TYPE_CHECKING:
    import torch

    from neuron_train.graphs.log import XlaEvent
    from neuron_train.graphs.recorder import Recorder

MODE_ENV = "NEURON_TRAIN_PROBE_MODE"          # tour | check | bench
STEPS_ENV = "NEURON_TRAIN_PROBE_STEPS"        # tour: steps before stopping; bench: measured steps
COVERED_ENV = "NEURON_TRAIN_PROBE_COVERED"    # check: a JSON list of the graph hashes precompiled
STAGING_ENV = "NEURON_TRAIN_PROBE_STAGING"    # tour: folder for torch_xla's persistent cache files
PROBE_PREFIX = "probe."
MODES = ("tour", "check", "bench")
STOP_EXIT = 3          # --require-precompiled stopped the process before an uncovered compile
MAX_WINDOWS = 20000    # steps kept per process (a bench or a tour stops long before)
WATCH_INTERVAL_S = 0.02
FAST_FORWARD_STEPS = 500  # at most, plus two epochs' steps, from the fast-forward to the script's end
HLO_DUMP_WAIT_S = 2.0    # at most, for the uncovered graph's HLO dump (usually there at once)


@dataclass
class Stop:
    reason: str            # "tour" (all call sites warm) | "bench" (enough steady steps) | "uncovered"
    step: int
    graph: str = ""        # uncovered: the graph's hash
    where: str = ""        # uncovered: its call site
    seconds_into_compile: float | None = None  # uncovered: compile start (logged) -> stop
    compiles_started: int = 0     # uncovered: compiles torch_xla had begun (its log) ...
    compiles_finished: int = 0    # ... and finished (CompileTime samples): fewer = stopped mid-compile


@dataclass
class ProbeRecord:
    pid: int
    mode: str
    steps_wanted: int
    windows: list[StepWindow] = field(default_factory=list)
    stop: Stop | None = None
    parameters: int = 0            # elements in the optimizers' parameters
    compiles: int = 0              # graphs compiled (UncachedCompile) ...
    compile_time_s: float = 0.0    # ... and their compile time (CompileTime), since the probe began
    staging: str = ""              # tour: this process's torch_xla persistent cache files
    device: str = ""               # torch_xla's device type, once a step ran
    tour: str = ""                 # how far the tour goes (epochs.py), said at its first step
    to_epoch_end: bool = False     # ... to the first epoch's end
    epoch_steps: int = 0           # ... whose length (the loader that fed the steps), when it does
    fast_forward: int = 0          # ... the step after which it fast-forwarded to the script's end (0: never)
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProbeRecord:
        """A record as `to_json` wrote it (`probe.<pid>.json`)."""
        stop = data.get("stop")
        return cls(**{**data, "windows": [StepWindow(**w) for w in data.get("windows", [])],
                      "stop": Stop(**stop) if stop else None})


class Probe:
    """One process's probe. `recorder` is the checker's (None under bench: the probe alone):
    steps are counted here from torch_xla's own counters, so both modes number them alike."""

    def __init__(self, recorder: Recorder | None, mode: str, folder: Path) -> None:
        self.rec, self.mode, self.folder = recorder, mode, folder
        self.is_internal = recorder.analyzer.is_internal if recorder is not None else internal_predicate()
        self.record = ProbeRecord(os.getpid(), mode, int(os.environ.get(STEPS_ENV, "0") or 0))
        self.lock = threading.Lock()
        self.steps = 0
        self.compiles0 = self.compiles = xla_counter("UncachedCompile")
        self.compile_s0 = xla_metric("CompileTime")[1]
        self.copy: tuple[int, list[int]] | None = None   # (elements, shape) of the largest copy
        self.seen_params: set[int] = set()
        self.written = False
        self.sites = Sites()
        self.epochs: Epochs | None = None   # tour to the first epoch's end (epochs.py)

    # ----- inputs ------------------------------------------------------------------------------
    def graph_runs(self) -> int:
        """Compile-cache lookups: one per sync that ran a graph, whether it compiled or not."""
        return xla_counter("UncachedCompile") + xla_counter("CachedCompile")

    def note_copy(self, tensor: torch.Tensor) -> None:
        """A tensor that arrived on the XLA device from the host."""
        try:
            size, shape = tensor.numel(), list(tensor.shape)
        except (AttributeError, RuntimeError):
            return
        with self.lock:
            if shape and (self.copy is None or size > self.copy[0]):
                self.copy = (size, shape)

    def note_parameters(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self.seen_params:
            return
        self.seen_params.add(id(optimizer))
        self.record.parameters += sum(p.numel() for g in optimizer.param_groups for p in g["params"])

    def step_ended(self, site: str) -> None:
        """After a sync that ran a graph (main thread or not): close the window, maybe stop."""
        compiles = xla_counter("UncachedCompile")
        with self.lock:
            copy, self.copy = self.copy, None
        self.steps += 1
        window = StepWindow(self.steps, time.perf_counter(), site, compiles - self.compiles,
                            copy[1] if copy else None, xla_metric("ExecuteTime")[1])
        self.compiles = compiles
        if len(self.record.windows) < MAX_WINDOWS:
            self.record.windows.append(window)
        self.sites.add(window)
        # The tour's extent is decided at the first step a loader fed: set-up syncs (a broadcast of
        # the weights, ZeRO-1's sharding) may come first. If the warm-sites rule would stop the tour
        # before any loader fed a step, it is decided then, with the words saying no loader was seen.
        if self.epochs is not None and not self.record.tour and self.epochs.feeding is not None:
            self._plan_tour()
        reason = self.sites.stop_reason(self.mode, self.record.steps_wanted, self.record.to_epoch_end)
        if reason and self.epochs is not None and not self.record.tour:
            self._plan_tour()
            reason = self.sites.stop_reason(self.mode, self.record.steps_wanted, self.record.to_epoch_end)
        if reason == "tour" and self.epochs is not None and self.record.to_epoch_end and self._fast(window.step):
            return  # fast-forwarding to the script's end: its last code compiles its graphs too
        if reason and self.record.stop is None:
            self.record.stop = Stop(reason, window.step)
            say(f"{STOP_WORDS[reason]} after step {window.step}: stopping {Path(sys.argv[0]).name} here")
            # Unwinds the training code (its finally blocks run); atexit then writes this record and
            # the checker's. From a worker thread (torch_xla.launch runs the function in one per
            # device) the exception reaches the process through the executor's future.
            raise SystemExit(0)

    def _fast(self, step: int) -> bool:
        """Fast-forward instead of stopping (epochs.py), within a budget of steps: a loop that counts
        steps rather than epochs (`while step < max_steps`) still stops here once it is spent."""
        assert self.epochs is not None
        if not self.record.fast_forward:
            self.record.fast_forward = step
            say(self.epochs.fast_forward())
        return step - self.record.fast_forward <= FAST_FORWARD_STEPS + 2 * self.record.epoch_steps

    def _plan_tour(self) -> None:
        assert self.epochs is not None
        self.record.to_epoch_end, self.record.tour = self.epochs.plan(self.record.steps_wanted)
        self.record.epoch_steps = (self.epochs.feeding or 0) if self.record.to_epoch_end else 0
        say(self.record.tour)

    # ----- output ------------------------------------------------------------------------------
    def write(self) -> None:
        if self.written:
            return
        self.written = True
        self.record.compiles = xla_counter("UncachedCompile") - self.compiles0
        self.record.compile_time_s = xla_metric("CompileTime")[1] - self.compile_s0
        if self.record.windows:
            import torch_xla.runtime as xr

            self.record.device = xr.device_type() or ""
        path = self.folder / f"{PROBE_PREFIX}{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record.to_json()))
        os.replace(tmp, path)


STOP_WORDS = {"tour": "graph tour complete (every call site warm)",
              "bench": "enough steady steps measured"}


# ----- arming ------------------------------------------------------------------------------------
def arm(recorder: Recorder | None, folder: Path) -> None:
    """Called by start.py in each process right after torch_xla's import (`recorder`: the checker's,
    None under bench)."""
    mode = os.environ.get(MODE_ENV, "")
    if mode not in MODES or (recorder is None and mode != "bench"):
        return  # only bench runs without the checker's recorder
    probe = Probe(recorder, mode, folder)
    atexit.register(probe.write)  # registered after the checker's: runs before it
    if mode in ("tour", "bench"):
        syncs.subscribe(_StepWindows(probe))
        _watch_copies(probe)
        _watch_optimizers(probe)
    if mode == "tour":
        _stage_cache(probe)
        if os.environ.get(EPOCH_ENV) == "1":
            probe.epochs = Epochs(probe.sites.epoch_began)
            probe.epochs.install()
    if mode == "check" and recorder is not None and os.environ.get(COVERED_ENV):
        covered = set(json.loads(Path(os.environ[COVERED_ENV]).read_text()))
        watch = CompileWatch(probe, recorder, covered)
        watch.start()
        atexit.register(watch.scan)  # registered after probe.write: runs before it


class _StepWindows:
    """Subscribed to graphs/syncs.py's one sync wrapper, after the checker (when there is one)."""

    def __init__(self, probe: Probe):
        self.probe = probe

    def before_sync(self) -> int:
        return self.probe.graph_runs()

    def after_sync(self, before: int, caller: FrameType | None) -> None:
        from neuron_train.graphs.frames import caller_line

        if self.probe.graph_runs() != before:  # this sync ran a graph: a step (an idle sync is not one)
            self.probe.step_ended(caller_line(self.probe.is_internal, caller) or "?")


def _watch_copies(probe: Probe) -> None:
    """Host-to-device copies: `Tensor.to` and the bulk copy MpDeviceLoader uses."""
    import torch
    import torch_xla

    to = torch.Tensor.to

    def copy_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = to(self, *args, **kwargs)
        if out is not self and out.device.type == "xla" and self.device.type != "xla":
            probe.note_copy(out)
        return out

    copy_to.__doc__ = to.__doc__
    # setattr: a deliberate patch of a method, which mypy refuses as an assignment (method-assign)
    setattr(torch.Tensor, "to", copy_to)  # noqa: B010
    from_aten = torch_xla._XLAC._xla_tensors_from_aten

    def tensors_from_aten(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        for t in tensors:
            probe.note_copy(t)
        return from_aten(tensors, *args, **kwargs)

    torch_xla._XLAC._xla_tensors_from_aten = tensors_from_aten


def _watch_optimizers(probe: Probe) -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: probe.note_parameters(optimizer))


def _stage_cache(probe: Probe) -> None:
    """torch_xla's persistent cache (devices other than Neuron), in a private staging folder the
    precompile command moves into the cache when the tour succeeded (store.commit_staged)."""
    staging = os.environ.get(STAGING_ENV)
    if not staging or os.environ.get("PJRT_DEVICE", "").upper() == "NEURON":
        return  # Neuron caches NEFFs itself, in NEURON_CC_FLAGS --cache_dir
    if os.environ.get("XLA_PERSISTENT_CACHE_PATH"):
        probe.record.note = "the command sets XLA_PERSISTENT_CACHE_PATH itself: its cache files stay there"
        return
    folder = Path(staging) / f"{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    # What xr.initialize_cache does; read when the first graph compiles, which is still to come.
    os.environ["XLA_PERSISTENT_CACHE_PATH"] = str(folder)
    os.environ["XLA_PERSISTENT_CACHE_READ_ONLY"] = "0"
    probe.record.staging = str(folder)


class CompileWatch(threading.Thread):
    """--require-precompiled: reads torch_xla's compile log while the program runs.

    torch_xla writes a graph's "Compilation Analysis" (its hash and Python frames) after lowering
    it and before calling the compiler, and releases the GIL while compiling: this thread sees an
    uncovered graph within WATCH_INTERVAL_S of its compile's start and ends the process there.
    The log is scanned once more as the process exits (atexit): on a loaded machine a short compile
    and the program's end can both fall between two of this thread's turns, and an uncovered graph
    must be named as the stop either way.
    """

    def __init__(self, probe: Probe, recorder: Recorder, covered: set[str]) -> None:
        super().__init__(name="neuron-train-require-precompiled", daemon=True)
        self.probe, self.rec, self.covered = probe, recorder, covered
        self.log = recorder.files.log
        self.offset = recorder.log_size()
        self.started = 0
        self.finished0 = self._finished()
        self.scanning = threading.Lock()  # the thread and the exit scan read the log in turn

    def _finished(self) -> int:
        return xla_metric("CompileTime")[0]

    def run(self) -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            self.scan()

    def scan(self) -> None:
        """Read what the log gained; stop at the first uncovered graph in it."""
        from neuron_train.graphs.log import parse_debug_log

        with self.scanning:
            try:
                with open(self.log, "rb") as f:
                    f.seek(self.offset)
                    text = f.read().decode("latin-1")
                    written = os.fstat(f.fileno()).st_mtime
            except FileNotFoundError:
                return
            events, used = parse_debug_log(text)
            self.offset += used
            for event in (e for e in events if e.kind == "compile"):
                self.started += 1
                if event.graph_hash and event.graph_hash not in self.covered:
                    self.stop(event, written)

    def _wait_for_hlo(self, event: XlaEvent) -> None:
        """XLA dumps a graph's HLO as its compile starts: wait (briefly) to record its input shapes."""
        from neuron_train.graphs.recorder import compiled_hlo

        deadline = time.monotonic() + HLO_DUMP_WAIT_S
        while self.rec.files.hlo_dir is not None and time.monotonic() < deadline:
            if compiled_hlo(self.rec.files.hlo_dir, event) is not None:
                return
            time.sleep(WATCH_INTERVAL_S)

    def stop(self, event: XlaEvent, logged_at: float) -> None:
        """Record why, write every record, end the compiler's processes and this one (exit 3)."""
        from neuron_train.graphs.log import user_frames
        from neuron_train.graphs.recorder import write_record

        frames = user_frames(event.frames, self.probe.is_internal)
        where = frames[0].where if frames else ""
        print(f"neuron-train: --require-precompiled: graph {event.graph_hash[:12]} at {where or '?'} is not "
              "precompiled: stopping before its compile finishes", file=sys.stderr, flush=True)
        try:
            self._wait_for_hlo(event)
            # Measured as the process ends: how far into the compile, and whether it had finished.
            self.probe.record.stop = Stop("uncovered", self.probe.steps, event.graph_hash, where,
                                          round(time.time() - logged_at, 3), self.started,
                                          self._finished() - self.finished0)
            write_record(self.rec, self.probe.folder)
            self.probe.write()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            end_descendants(os.getpid())  # e.g. neuronx-cc, which the Neuron plugin runs as a child
            os._exit(STOP_EXIT)


def end_descendants(pid: int) -> None:
    """SIGTERM every process below `pid`, deepest first: a compiler the Neuron plugin started as a
    child would otherwise go on for minutes as an orphan."""
    for child in reversed(descendants(pid)):
        try:
            os.kill(child, signal.SIGTERM)
        except ProcessLookupError:
            pass
