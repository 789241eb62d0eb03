"""`neuron-train bench -- CMD`: the steady-state throughput of any PyTorch/XLA training script.

The command runs once per repeat with the probe in bench mode (instrument/probe.py): each
sync that ran a graph closes a step window, timed when the sync returns. The steady state of a run
(its step, step time, throughput, samples per step) is read by cost/script_figures.py, which plan
shares. Windows before the first
steady interval (warm-up) and compile time (torch_xla's CompileTime; graphs = UncachedCompile, the
most of any process) are reported apart, never mixed in. The process stops by itself after N
steady intervals (--steps; 0 runs the command to its end). The probe runs without the graph
checker (instrument/start.py arms the probe alone): no debug log or HLO dump is paid on the measured steps.
"""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

from neuron_train.common.fileio import short
from neuron_train.cost.bench.measure import Measurement, Workload
from neuron_train.cost.script_figures import ScriptFigures, figures, script_name
from neuron_train.instrument.script import require_ran, run_script

DEFAULT_STEPS = 20      # steady intervals measured when --steps is not given


def measure_command(command: list[str], *, steps: int, samples_flag: int | None, echo: bool) -> ScriptFigures:
    """One run of the command under the probe, and its steady-state figures."""
    with tempfile.TemporaryDirectory(prefix="neuron-train-bench-") as folder:
        run = run_script(command, Path(folder), mode="bench", steps=steps, echo=echo)
    require_ran(run, "nothing was measured", stopped_ok=("bench",))
    return figures(run, samples_flag)


def describe(f: ScriptFigures) -> str:
    shape = "x".join(map(str, f.batch_shape)) if f.batch_shape else "?"
    source = "--samples-per-step" if f.batch_source == "flag" else f"input batch {shape}"
    return (f"{f.samples_per_sec:.1f} samples/s, step {f.step_time_ms:.2f} ms (median of {f.measured_steps} "
            f"steady steps at {short(f.site)}; {f.samples_per_step} samples/step from {source}; "
            f"{f.warmup_steps} warm-up step(s) and {f.graph_count} graph(s), {f.compile_time_s:.1f} s of "
            "compiling, not counted)")


def script_workload(command: list[str], f: ScriptFigures, *, name: str | None,
                    train_samples: int | None) -> Workload:
    """What the report can say about a script: its name, the parameters its optimizers update, the
    image size when the batch is square images (N, C, H, H); the rest is unknown (null)."""
    shape = f.batch_shape or []
    return Workload(
        model=name or script_name(command), parameters=f.parameters or None,
        img_size=shape[2] if len(shape) == 4 and shape[2] == shape[3] else None, num_classes=None,
        dataset="the script's own", train_samples=train_samples, batch_size=f.samples_per_step,
        precision="the script's own",
        config={"command": shlex.join(command), "samples_per_step": f.samples_per_step,
                "samples_per_step_from": f.batch_source, "batch_shape": f.batch_shape, "step_site": f.site})


def to_measurement(f: ScriptFigures) -> Measurement:
    return Measurement(f.samples_per_sec, f.step_time_ms, f.compile_time_s, f.graph_count, f.measured_steps,
                       f.world_size, f.samples_per_step * f.world_size, f.device,
                       details={"warmup_steps": f.warmup_steps, "step_site": f.site, "batch_shape": f.batch_shape})
