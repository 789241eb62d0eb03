"""The steady state of a command run under the probe in bench mode (instrument/probe.py), read by
`bench -- CMD` (cost/bench/script_bench.py) to measure it and by `plan -- CMD` (cost/plan/measure.py)
to count its step: the step is the call site with the most steady intervals; a steady interval runs
from one of its windows to the next, both compiling nothing (instrument/steps.Sites). Step time is
their median; throughput is samples per step x steady intervals / their summed time, summed over the
processes. Samples per step: --samples-per-step, else the leading dimension of the input batch, the
largest host-to-device copy of most steady windows.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from neuron_train.common.errors import RunError
from neuron_train.instrument.probe import ProbeRecord
from neuron_train.instrument.script import ScriptRun
from neuron_train.instrument.steps import fold

MIN_INTERVALS = 3       # fewer steady intervals than this is no measurement


@dataclass
class ProcessSteps:
    """One process's steady state."""

    site: str                  # the step's call site
    intervals: list[float]     # seconds of each steady interval
    warmup_windows: int        # step windows before the first steady interval
    batch: list[int] | None    # the input batch's shape (the largest copy of most steady windows)
    parameters: int            # elements the process's optimizers update
    device: str


@dataclass
class ScriptFigures:
    """What `bench -- CMD` measured in one run of the command (all processes)."""

    samples_per_sec: float
    step_time_ms: float
    samples_per_step: int      # per process
    world_size: int            # processes that measured steps
    measured_steps: int        # steady intervals of the slowest-measured process
    warmup_steps: int
    compile_time_s: float
    graph_count: int
    batch_shape: list[int] | None
    batch_source: str          # "flag" or "input batch"
    site: str
    parameters: int
    device: str


def process_steps(probe: ProbeRecord) -> ProcessSteps | None:
    windows = probe.windows
    sites = fold(windows)
    main = sites.main_site()
    if main is None or not main[1].steady:
        return None
    site, state = main
    shapes = Counter(tuple(shape) for i, _ in state.steady if (shape := windows[i].batch))
    if not shapes:  # a prefetching loader (MpDeviceLoader) copied the first batches during the warm-up
        shapes = Counter(tuple(w.batch) for w in windows if w.batch)
    batch = list(shapes.most_common(1)[0][0]) if shapes else None
    return ProcessSteps(site, [seconds for _, seconds in state.steady], state.steady[0][0] - 1, batch,
                        probe.parameters, probe.device)


def figures(run: ScriptRun, samples_flag: int | None) -> ScriptFigures:
    """Steady-state figures of one instrumented run (pure)."""
    steps = [s for s in (process_steps(p) for p in run.probes) if s is not None]
    usable = [s for s in steps if len(s.intervals) >= MIN_INTERVALS]
    if not usable:
        most = max((len(s.intervals) for s in steps), default=0)
        raise RunError(f"{run.line}: only {most} steady step(s) measured (a step is a sync that ran the same "
                       f"graph again without compiling; {MIN_INTERVALS} are needed): raise --steps, or give a "
                       "command that runs more steps")
    batch = usable[0].batch
    if samples_flag:
        per_step, source = samples_flag, "flag"
    elif batch:
        per_step, source = batch[0], "input batch"
    else:
        raise RunError(f"{run.line}: no host-to-device batch copy in the steady steps (data made on the device?): "
                       "pass --samples-per-step N")
    rates = [per_step * len(s.intervals) / sum(s.intervals) for s in usable]
    return ScriptFigures(
        samples_per_sec=sum(rates), step_time_ms=max(statistics.median(s.intervals) for s in usable) * 1e3,
        samples_per_step=per_step, world_size=len(usable),
        measured_steps=min(len(s.intervals) for s in usable),
        warmup_steps=max(s.warmup_windows for s in usable),
        compile_time_s=max(p.compile_time_s for p in run.probes),
        graph_count=max(p.compiles for p in run.probes), batch_shape=batch, batch_source=source,
        site=usable[0].site,
        parameters=max(s.parameters for s in usable), device=usable[0].device or "CPU")


def script_name(command: list[str]) -> str:
    """How the report names a script's workload: its .py file, else the program."""
    scripts = [Path(a).name for a in command if a.endswith(".py")]
    return scripts[0] if scripts else Path(command[0]).name
