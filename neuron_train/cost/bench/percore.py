"""Inference on every NeuronCore of the instance at once: one worker process per NeuronCore, each
pinned to its core with NEURON_RT_VISIBLE_CORES (the Neuron runtime's variable), each running its own
copy of the traced model. This is how the Neuron SDK's published inference figures are made (data
parallel over every core of the instance), so the sum of the per-core figures is comparable to them;
one traced module in one process measures one core only.

The protocol with a worker (`neuron_train.cost.bench.core_worker` on Neuron hardware; a stand-in in the
tests): the worker loads its copy onto its core, runs its warm-up steps, prints a line `READY` and
waits for one line on stdin; it then runs its timed steps and prints one JSON line
`{"samples_per_sec": ..., "step_time_ms": ...}` and exits 0. The parent sends that line to every
worker only once all are ready, so the timed windows overlap: no core is timed while another is
still loading or compiling. Only stdout carries the protocol: the worker's stderr (the Neuron
runtime's log lines, which may come after the result) goes to a file of its own, read for the
reason when the worker fails; the result is the last stdout line that parses as one.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from neuron_train.cost.bench.failures import MeasureFailed, classify_failure

READY = "READY"
CORES_ENV = "NEURON_RT_VISIBLE_CORES"


@dataclass
class CoreFigure:
    core: int
    samples_per_sec: float
    step_time_ms: float


def _start(worker: Sequence[str], core: int, env: Mapping[str, str], stderr: IO[str]) -> subprocess.Popen:
    return subprocess.Popen(list(worker), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                            text=True, bufsize=1, env={**env, CORES_ENV: str(core)})


def _failed(proc: subprocess.Popen, core: int, output: list[str], stderr: IO[str]) -> MeasureFailed:
    """The worker's failure, classified on everything it said (stdout, then its stderr file)."""
    code = proc.wait()
    stderr.seek(0)
    failed = classify_failure(code, "".join(output) + stderr.read())
    return MeasureFailed(failed.status, f"NeuronCore {core}: {failed.reason}")


def _wait_ready(proc: subprocess.Popen, core: int, output: list[str], stderr: IO[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == READY:
            return
        output.append(line)
    raise _failed(proc, core, output, stderr)


def _result(line: str) -> tuple[float, float] | None:
    try:
        data = json.loads(line)
        return float(data["samples_per_sec"]), float(data["step_time_ms"])
    except (ValueError, KeyError, TypeError):
        return None


def _figure(proc: subprocess.Popen, core: int, output: list[str], stderr: IO[str]) -> CoreFigure:
    assert proc.stdout is not None
    rest = proc.stdout.read()
    output.append(rest)
    lines = [ln for ln in rest.splitlines() if ln.strip()]
    if proc.wait() != 0 or not lines:
        raise _failed(proc, core, output, stderr)
    results = [r for r in map(_result, lines) if r is not None]
    if not results:
        raise MeasureFailed("failed", f"NeuronCore {core}: no line of the worker's output is its result; the "
                                      f"last: {lines[-1][:200]}")
    return CoreFigure(core, *results[-1])


def run_per_core(worker: Sequence[str], cores: Sequence[int],
                 env: Mapping[str, str] | None = None) -> list[CoreFigure]:
    """Start `worker` once per core, release them together, return each core's figure.

    Any worker that fails fails the measurement (with its core and its reason); every worker still
    running is then killed, so no process keeps a NeuronCore."""
    env = os.environ if env is None else env
    # a file, not a pipe: a worker's runtime log could fill an unread pipe and block it
    errs = [tempfile.TemporaryFile("w+") for _ in cores]
    procs = [_start(worker, core, env, err) for core, err in zip(cores, errs, strict=True)]
    outputs: list[list[str]] = [[] for _ in cores]
    each = list(zip(procs, cores, outputs, errs, strict=True))
    try:
        for proc, core, out, err in each:
            _wait_ready(proc, core, out, err)
        for proc in procs:  # all loaded and warm: start every timed window at the same moment
            assert proc.stdin is not None
            proc.stdin.write("GO\n")
            proc.stdin.flush()
        return [_figure(proc, core, out, err) for proc, core, out, err in each]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        for err in errs:
            err.close()


def instance_figure(figures: Sequence[CoreFigure]) -> tuple[float, float]:
    """(samples/s of the instance, step time in ms): the per-core throughputs measured in the same
    window add up; the step time is the slowest core's (the instance is as fast as its slowest copy)."""
    return sum(f.samples_per_sec for f in figures), max(f.step_time_ms for f in figures)
