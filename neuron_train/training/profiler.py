"""Step-phase profiler (`--profile`): where each training step's wall time goes, and the bottleneck.

Two kinds of figures, kept apart on purpose:
- Host phases, perf_counter marks on the main thread, which partition each step's wall time. Lazy
  XLA ops only *record* a graph, so the forward / backward / optimizer phases are tracing time, not
  execution. `next(batches)` is split in two by a step closure (it runs at the end of the loader's
  `torch_xla.sync()`): the graph cut (building and hashing the graph, dispatching it, and waiting
  for the device if earlier executions still hold it: XLA's DeviceLockWait) and the input wait
  (taking the batch from the loader's queue). The gradient-sync phase is a trace of collectives on
  Neuron, but host syncs and gloo traffic on the CPU bridge.
- XLA metrics (process-wide accumulators, deltas per step): ExecuteTime (dispatch to completion of a
  device computation), CompileTime, TransferToDeviceTime, TransferFromDeviceTime. The device runs
  while the host traces the next step, so these overlap the host phases and never add up with them.

With `--profile` off the loop holds a NullProfiler: no clock reads, no metric reads, no syncs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from neuron_train.common.errors import UsageError
from neuron_train.common.fileio import write_json_atomic

if TYPE_CHECKING:
    from neuron_train.training.config import RunConfig

_B = TypeVar("_B")  # a batch, whatever the loader makes

PHASES = ("data_wait", "graph_cut", "forward", "backward", "grad_sync", "optimizer", "loop", "profiler")
XLA_METRICS = {"execute": "ExecuteTime", "compile": "CompileTime",
               "transfer_to_device": "TransferToDeviceTime",
               "transfer_from_device": "TransferFromDeviceTime", "device_lock_wait": "DeviceLockWait"}
_STEADY_COMPILE_SHARE = 0.05  # steady-state compile above this share of a step: recompiling
_RUN_COMPILE_SHARE = 0.5      # a run that compiled more than half its wall time is compile-bound


def xla_metric_ms(name: str) -> float:
    """A torch_xla timing metric's accumulated total in ms (0 before its first sample).

    A host-side counter read, no device sync; it costs ~0.15 ms once 1024 samples are kept.
    """
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return data[1] / 1e6 if data else 0.0


def xla_totals() -> dict[str, float]:
    return {key: xla_metric_ms(name) for key, name in XLA_METRICS.items()}


class NullProfiler:
    """`--profile` off: every hook does nothing."""

    def next(self, batches: Iterator[_B]) -> _B:
        return next(batches)

    def mark(self, phase: str) -> None:
        pass

    def end_step(self, step: int, excluded: bool = False) -> None:
        pass

    def finish(self) -> dict | None:
        return None


class StepProfiler:
    """Per-step phase records. Hooks: `next(batches)` in place of `next(batches)`, `mark(phase)`
    at the end of each phase of the step, `end_step(step)` once the loop is done with the step."""

    def __init__(self, *, warmup_steps: int, out_dir: Path | None = None, trace_steps: int = 0,
                 clock: Callable[[], float] = time.perf_counter,
                 totals: Callable[[], dict[str, float]] = xla_totals, lock_wait: Callable[[], float] | None = None,
                 add_closure: Callable[[Callable[[], None]], None] | None = None):
        """`out_dir`: where profile.json and the trace go, and the table is printed (rank 0 only).
        `clock`, `totals`, `lock_wait`, `add_closure`: the real ones unless a test passes fakes."""
        self.warmup_steps, self.out_dir = warmup_steps, out_dir
        self.trace_steps = trace_steps if out_dir is not None else 0
        self.trace_dir = Path(out_dir or ".") / "xla-trace"
        self._clock, self._totals = clock, totals
        self._lock_wait = lock_wait or (lambda: xla_metric_ms(XLA_METRICS["device_lock_wait"]))
        self._add_closure = add_closure or _xla_step_closure
        self._cut_at: float | None = None
        self._cut_pending = False
        self.records: list[dict] = []
        self.trace_path: str | None = None
        self._trace_from: int | None = None
        self._first_step: int | None = None
        self._xla = self._xla_start = totals()
        self._start = self._last = self._step_start = clock()
        self._reset()

    def _reset(self) -> None:
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._lock_in_cut = 0.0
        self._traced = self._trace_from is not None and self.trace_path is None

    def _advance(self, phase: str) -> float:
        now = self._clock()
        self._phases[phase] += now - self._last
        self._last = now
        return now

    def _overhead(self, since: float) -> None:
        now = self._clock()
        self._phases["profiler"] += now - since
        self._last = now

    def mark(self, phase: str) -> None:
        self._advance(phase)

    def next(self, batches: Iterator[_B]) -> _B:
        t = self._advance("data_wait")
        before = self._lock_wait()
        self._cut_at = None
        if not self._cut_pending:  # runs at the end of the next torch_xla.sync()
            self._add_closure(self._on_cut)
            self._cut_pending = True
        self._overhead(t)
        start = self._last
        batch = next(batches)
        end = self._clock()
        if self._cut_at is not None:  # the loader cut the graph before taking the batch
            self._phases["graph_cut"] += self._cut_at - start
            self._phases["data_wait"] += end - self._cut_at
        else:                         # --batches-per-execution > 1: no cut at this batch
            self._phases["data_wait"] += end - start
        self._last = end
        self._lock_in_cut += self._lock_wait() - before
        self._overhead(end)
        return batch

    def _on_cut(self) -> None:
        self._cut_at, self._cut_pending = self._clock(), False

    def end_step(self, step: int, excluded: bool = False) -> None:
        """Close step `step` (0-based). `excluded`: the loop evaluated or checkpointed after it."""
        t = self._advance("loop")
        if self._first_step is None:
            self._first_step = step
        totals = self._totals()
        xla = {k: totals[k] - self._xla[k] for k in totals}
        self._xla = totals
        self._trace_control(step, self._first_step)
        self._overhead(t)
        self.records.append({
            "step": step, "wall_ms": (self._last - self._step_start) * 1e3,
            "phases_ms": {k: v * 1e3 for k, v in self._phases.items()},
            "device_wait_in_cut_ms": self._lock_in_cut, "xla_ms": xla,
            "warmup": step < self._first_step + self.warmup_steps, "excluded": excluded,
            "traced": self._traced,
        })
        self._step_start = self._last
        self._reset()

    def _trace_control(self, step: int, first_step: int) -> None:
        """Trace `trace_steps` steps from the first steady step (compiles stay out of the trace)."""
        if not self.trace_steps or self.trace_path is not None:
            return
        import torch_xla.debug.profiler as xp

        if self._trace_from is None and step + 1 >= first_step + max(self.warmup_steps, 1):
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            xp.start_trace(str(self.trace_dir))  # a local session: no profiler server (port) needed
            self._trace_from, self._traced = step + 1, True
        elif self._trace_from is not None and step + 1 >= self._trace_from + self.trace_steps:
            self._stop_trace()

    def _stop_trace(self) -> None:
        import torch_xla.debug.profiler as xp

        xp.stop_trace()
        chrome = sorted(self.trace_dir.glob("plugins/profile/*/*.trace.json.gz"))
        self.trace_path = str(chrome[-1] if chrome else self.trace_dir)

    def finish(self) -> dict:
        if self._trace_from is not None and self.trace_path is None:
            self._stop_trace()  # the run ended before the traced steps did
        totals = self._totals()
        run = {"run_wall_s": self._clock() - self._start,
               "compile_total_s": (totals["compile"] - self._xla_start["compile"]) / 1e3}
        summary = summarize(self.records, **run) | {"trace": self.trace_path}
        if self.out_dir is not None:
            write_json_atomic(Path(self.out_dir) / "profile.json", {"summary": summary, "steps": self.records})
            print(format_table(summary), flush=True)
        return summary


def _xla_step_closure(fn: Callable[[], None]) -> None:
    import torch_xla.core.xla_model as xm

    xm.add_step_closure(fn)


def build_profiler(cfg: RunConfig, out_dir: Path | None) -> NullProfiler | StepProfiler:
    """The loop's profiler; `out_dir` None on ranks that write nothing."""
    p = cfg.profile
    if p.profile_trace_steps and not p.profile:
        raise UsageError("--profile-trace-steps needs --profile")
    if not p.profile:
        return NullProfiler()
    return StepProfiler(warmup_steps=cfg.train.warmup_measure_steps, out_dir=out_dir,
                        trace_steps=p.profile_trace_steps)


# ----- summary and verdict (pure) -------------------------------------------------------------
@dataclass
class Figures:
    """Mean ms per step over the steady steps, plus whole-run compile figures."""

    wall: float
    input_wait: float    # taking the batch from the loader's queue
    device_wait: float   # in the graph cut, waiting for earlier executions (DeviceLockWait)
    host: float          # forward + backward + optimizer tracing + the graph cut's own host work
    grad_sync: float     # gradient reduction (and the ZeRO-1 step)
    other: float         # loop bookkeeping + profiler overhead
    execute: float       # XLA ExecuteTime
    compile: float       # XLA CompileTime in steady steps
    compile_total_s: float
    run_wall_s: float


ADVICE = {
    "compile-bound": "a longer run amortises the compiles; precompile (neuron_parallel_compile) into a "
                     "persistent cache; if steady steps recompile, find the cause with --check-graphs",
    "input-bound": "raise --num-workers, or --batches-per-execution (fewer graph cuts per batch), "
                   "or store the data pre-decoded at the training resolution",
    "host-bound": "Python tracing outpaces the device's work: raise --batch-size (the trace costs the "
                  "same per step, the device gets more work per trace) or trace fewer ops per step",
    "device-bound": "the device is the limit (the goal on Neuron): bf16 (--precision bf16-autocast), "
                    "a smaller model or image size, or more data-parallel ranks",
}


def classify(f: Figures, whole_run: bool = True) -> tuple[str, str]:
    """(bottleneck, the figures that justify it). `whole_run` False: the steady state only, leaving
    out the one-time compiles of a run too short to amortise them."""
    if whole_run and f.run_wall_s > 0 and f.compile_total_s > _RUN_COMPILE_SHARE * f.run_wall_s:
        return "compile-bound", (f"compiling took {f.compile_total_s:.1f} s of the run's "
                                 f"{f.run_wall_s:.1f} s")
    if f.compile > _STEADY_COMPILE_SHARE * f.wall:
        return "compile-bound", (f"steady steps still compile: {f.compile:.1f} ms/step of a "
                                 f"{f.wall:.1f} ms step")
    device = max(f.execute, f.device_wait + f.grad_sync)
    candidates = {"input-bound": f.input_wait, "host-bound": f.host, "device-bound": device}
    name = max(candidates, key=candidates.__getitem__)
    figures = (f"input wait {f.input_wait:.1f} ms, host tracing and graph cuts {f.host:.1f} ms, "
               f"device execution {f.execute:.1f} ms, waiting for the device and gradient sync "
               f"{f.device_wait + f.grad_sync:.1f} ms, per {f.wall:.1f} ms step")
    return name, figures


def summarize(records: list[dict], *, run_wall_s: float, compile_total_s: float) -> dict:
    steady = [r for r in records if not (r["warmup"] or r["excluded"] or r["traced"])]
    basis = steady or [r for r in records if not r["excluded"]] or records
    if not basis:
        return {"steps_profiled": 0}

    def mean(get: Callable[..., float]) -> float:  # get(record): some take a bound default too
        return sum(get(r) for r in basis) / len(basis)

    phases = {p: mean(lambda r, p=p: r["phases_ms"][p]) for p in PHASES}
    xla = {k: mean(lambda r, k=k: r["xla_ms"][k]) for k in XLA_METRICS}
    device_wait = mean(lambda r: r["device_wait_in_cut_ms"])
    f = Figures(wall=mean(lambda r: r["wall_ms"]), input_wait=phases["data_wait"],
                device_wait=device_wait,
                host=phases["forward"] + phases["backward"] + phases["optimizer"]
                + phases["graph_cut"] - device_wait,
                grad_sync=phases["grad_sync"], other=phases["loop"] + phases["profiler"],
                execute=xla["execute"], compile=xla["compile"], compile_total_s=compile_total_s,
                run_wall_s=run_wall_s)
    name, why = classify(f)
    steady_name, steady_why = classify(f, whole_run=False)
    return {
        "steps_profiled": len(records), "steady_steps": len(steady),
        "basis": "steady steps" if steady else "all steps (no steady step: warm-up included)",
        "left_out": {"warmup": sum(r["warmup"] for r in records),
                     "eval_or_checkpoint": sum(r["excluded"] for r in records),
                     "traced": sum(r["traced"] for r in records)},
        "step_wall_ms_median": statistics.median(r["wall_ms"] for r in basis),
        "phases_ms_per_step": phases, "figures_ms_per_step": asdict(f), "xla_ms_per_step": xla,
        "bottleneck": name, "reason": why, "advice": ADVICE[name],
        "steady_bottleneck": steady_name, "steady_reason": steady_why,
        "steady_advice": ADVICE[steady_name],
    }


def format_table(s: dict) -> str:
    """The end-of-run table (rank 0)."""
    if not s.get("steps_profiled"):
        return "step-phase profile: no step recorded"
    f, p, x = s["figures_ms_per_step"], s["phases_ms_per_step"], s["xla_ms_per_step"]
    wall = f["wall"] or 1.0
    rows = [("input wait (the loader's queue)", f["input_wait"]),
            ("graph cut: host work (build, hash, dispatch)", p["graph_cut"] - f["device_wait"]),
            ("graph cut: waiting for the device", f["device_wait"]),
            ("forward tracing", p["forward"]), ("backward tracing", p["backward"]),
            ("gradient sync (all-reduce; the ZeRO-1 step)", p["grad_sync"]),
            ("optimizer tracing", p["optimizer"]),
            ("loop (logging, eval/checkpoint checks)", p["loop"]),
            ("profiler overhead", p["profiler"])]
    lo = s["left_out"]
    lines = [f"step-phase profile: {s['steps_profiled']} steps, figures over {s['basis']} "
             f"({s['steady_steps']}; left out: {lo['warmup']} warm-up, {lo['eval_or_checkpoint']} "
             f"with eval/checkpoint, {lo['traced']} traced)",
             f"  {'host phases (main thread; they add up to the step)':<52}{'ms/step':>9}{'share':>8}"]
    lines += [f"  {name:<52}{ms:>9.1f}{100 * ms / wall:>7.1f}%" for name, ms in rows]
    lines.append(f"  {'step wall time (mean; median ' + format(s['step_wall_ms_median'], '.1f') + ')':<52}"
                 f"{f['wall']:>9.1f}{100.0:>7.1f}%")
    lines.append("  XLA metrics (process-wide; the device runs while the host traces: not additive)")
    lines += [f"  {'device execution (ExecuteTime, dispatch->done)':<52}{x['execute']:>9.1f}",
              f"  {'compile (CompileTime) in these steps':<52}{x['compile']:>9.1f}"
              f"   whole run: {f['compile_total_s']:.1f} s of {f['run_wall_s']:.1f} s",
              f"  {'host->device transfer (TransferToDeviceTime)':<52}{x['transfer_to_device']:>9.1f}",
              f"  {'device->host transfer (TransferFromDeviceTime)':<52}{x['transfer_from_device']:>9.1f}",
              f"bottleneck: {s['bottleneck']}: {s['reason']}",
              f"  what to try: {s['advice']}"]
    if s["steady_bottleneck"] != s["bottleneck"]:
        lines += [f"steady state: {s['steady_bottleneck']}: {s['steady_reason']}",
                  f"  what to try: {s['steady_advice']}"]
    if s.get("trace"):
        lines.append(f"xla profiler trace: {s['trace']}")
    return "\n".join(lines)
