"""Inference on every NeuronCore of the instance at once: one worker process per NeuronCore, each
pinned to its core with NEURON_RT_VISIBLE_CORES (the Neuron runtime's variable), each running its own
copy of the traced model. This is how the Neuron SDK's published inference figures are made (data
parallel over every core of the instance), so the sum of the per-core figures is comparable to them;
one traced module in one process measures one core only.

The protocol with a worker (`neuron_train.cost.core_worker` on Neuron hardware; a stand-in in the
tests): the worker loads its copy onto its core, runs its warm-up steps, prints a line `READY` and
waits for one line on stdin; it then runs its timed steps and prints one JSON line
`{"samples_per_sec": ..., "step_time_ms": ...}` and exits 0. The parent sends that line to every
worker only once all are ready, so the timed windows overlap: no core is timed while another is
still loading or compiling.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from neuron_train.cost.failures import MeasureFailed, classify_failure

READY = "READY"
CORES_ENV = "NEURON_RT_VISIBLE_CORES"


@dataclass
class CoreFigure:
    core: int
    samples_per_sec: float
    step_time_ms: float


def _start(worker: Sequence[str], core: int, env: Mapping[str, str]) -> subprocess.Popen:
    return subprocess.Popen(list(worker), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**env, CORES_ENV: str(core)})


def _wait_ready(proc: subprocess.Popen, core: int, output: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == READY:
            return
        output.append(line)
    failed = classify_failure(proc.wait(), "".join(output))
    raise MeasureFailed(failed.status, f"NeuronCore {core}: {failed.reason}")


def _figure(proc: subprocess.Popen, core: int, output: list[str]) -> CoreFigure:
    assert proc.stdout is not None
    rest = proc.stdout.read()
    output.append(rest)
    code = proc.wait()
    lines = [ln for ln in rest.splitlines() if ln.strip()]
    if code != 0 or not lines:
        failed = classify_failure(code, "".join(output))
        raise MeasureFailed(failed.status, f"NeuronCore {core}: {failed.reason}")
    try:
        data = json.loads(lines[-1])
        return CoreFigure(core, float(data["samples_per_sec"]), float(data["step_time_ms"]))
    except (ValueError, KeyError, TypeError):
        raise MeasureFailed("failed", f"NeuronCore {core}: the worker's last line is not its result: "
                                      f"{lines[-1][:200]}") from None


def run_per_core(worker: Sequence[str], cores: Sequence[int],
                 env: Mapping[str, str] | None = None) -> list[CoreFigure]:
    """Start `worker` once per core, release them together, return each core's figure.

    Any worker that fails fails the measurement (with its core and its reason); every worker still
    running is then killed, so no process keeps a NeuronCore."""
    env = os.environ if env is None else env
    procs = [_start(worker, core, env) for core in cores]
    outputs: list[list[str]] = [[] for _ in cores]
    try:
        for proc, core, out in zip(procs, cores, outputs, strict=True):
            _wait_ready(proc, core, out)
        for proc in procs:  # all loaded and warm: start every timed window at the same moment
            assert proc.stdin is not None
            proc.stdin.write("GO\n")
            proc.stdin.flush()
        return [_figure(proc, core, out) for proc, core, out in zip(procs, cores, outputs, strict=True)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


def instance_figure(figures: Sequence[CoreFigure]) -> tuple[float, float]:
    """(samples/s of the instance, step time in ms): the per-core throughputs measured in the same
    window add up; the step time is the slowest core's (the instance is as fast as its slowest copy)."""
    return sum(f.samples_per_sec for f in figures), max(f.step_time_ms for f in figures)
