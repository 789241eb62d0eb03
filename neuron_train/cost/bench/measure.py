"""One measurement for `neuron-train bench`: a training run of our loop (in its own process group,
read back from its summary.json) or a timed compiled forward pass; failures classified as
out-of-memory or other, with the line that says why.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

from neuron_train.common.errors import UsageError
from neuron_train.common.fileio import write_text_atomic
from neuron_train.common.stats import median_and_spread
from neuron_train.cost.bench.failures import MeasureFailed, classify_failure
from neuron_train.instrument import proc
from neuron_train.training.config import RunConfig
from neuron_train.training.config_io import config_to_argv
from neuron_train.training.summary import RunSummary

if TYPE_CHECKING:  # torch itself is imported when a bench starts
    from torch import Tensor

RUN_SCRIPT = Path(__file__).resolve().parents[2] / "run.py"
OUTPUT_LINES = 1_000_000  # a run's whole output is kept (output.log)


@dataclass
class Measurement:
    samples_per_sec: float
    step_time_ms: float
    compile_time_s: float
    graph_count: int
    measured_steps: int
    world_size: int
    global_batch_size: int
    device_kind: str
    device_info: dict = field(default_factory=dict)   # e.g. the tracer that compiled the forward
    details: dict = field(default_factory=dict)       # e.g. the training run's final loss


@dataclass
class Workload:
    """What a result measured, as the result file and the report name it (our loop's model and
    dataset, or a script's command)."""

    model: str
    parameters: int | None     # None: not known (for a script: no optimizer step seen)
    img_size: int | None       # None: not an image model, or not known
    num_classes: int | None    # None: not known
    dataset: str
    train_samples: int | None  # None: not known (the report then shows no cost per epoch)
    batch_size: int            # per device
    precision: str
    config: dict               # the settings or the command that reproduce it


def _run_command(cfg: RunConfig, nproc: int, out_dir: Path) -> list[str]:
    argv = [*config_to_argv(cfg), "--output-dir", str(out_dir), "--no-progress", "--no-tensorboard"]
    if nproc == 1:
        return [sys.executable, str(RUN_SCRIPT), *argv]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(RUN_SCRIPT), *argv]


def step_time_ms(s: RunSummary) -> tuple[float, str]:
    """A run's step time for a bench record, and what it is: the median of its steps, or where the run
    was too short for its laps to time the steps (a captured step's host runs ahead of the device:
    training/throughput.py), the window's mean step, the one samples/s is made from."""
    if s.step_time_ms_median is not None:
        return s.step_time_ms_median, "median of steps"
    assert s.samples_per_sec  # measure_train refuses a run without it
    return s.global_batch_size / s.samples_per_sec * 1e3, "window mean (too few steps for a median)"


def measure_train(cfg: RunConfig, nproc: int, workdir: Path) -> Measurement:
    """One run of our training loop in a fresh process group; reads its summary.json."""
    out_dir = Path(tempfile.mkdtemp(prefix=f"train-b{cfg.train.batch_size}-n{nproc}-", dir=workdir))
    cmd = _run_command(cfg, nproc, out_dir / "run")
    # Its own process group, ended with us (a kill -9 of bench leaves no run.py behind).
    ended = proc.run(cmd, dict(os.environ), stdout_too=True, tail_lines=OUTPUT_LINES, echo=False)
    output = "\n".join(ended.tail)
    write_text_atomic(out_dir / "output.log", output)
    summary_path = out_dir / "run" / "summary.json"
    if ended.code != 0:
        raise classify_failure(ended.code, output)
    if not summary_path.is_file():
        raise MeasureFailed("failed", f"the run exited 0 but wrote no summary.json ({shlex.join(cmd)})")
    s = RunSummary.from_json(summary_path)
    if not s.samples_per_sec:
        raise MeasureFailed("failed", f"no steady-state steps measured ({s.measured_steps} "
                                      "after warm-up): raise --max-steps")
    step_ms, step_from = step_time_ms(s)
    return Measurement(s.samples_per_sec, step_ms, s.compile_time_s, s.compile_count,
                       s.measured_steps, s.world_size, s.global_batch_size, s.device,
                       details={"final_loss": s.final_loss, "eval_accuracy": s.eval_accuracy,
                                "xla_execute_ms_median": s.xla_execute_ms_median, "step_time_ms_from": step_from})


# Neuron compiler casting per precision (explicit: the compiler's default changed across releases).
_NEURONX_CAST = {"fp32": ["--auto-cast", "none"],
                 "bf16-autocast": ["--auto-cast", "matmult", "--auto-cast-type", "bf16"],
                 "bf16": ["--auto-cast", "none"],
                 "xla-use-bf16": ["--auto-cast", "all", "--auto-cast-type", "bf16"],
                 "xla-downcast-bf16": ["--auto-cast", "all", "--auto-cast-type", "bf16"]}


INF1_BENCH = "scripts/inf1_bench.py"
CORE_WORKER = "neuron_train.cost.bench.core_worker"
# NeuronPerf's max-throughput setting, the one behind the published inference rows: two worker
# threads per model per NeuronCore ("for N models, use 2 * N worker threads", NeuronPerf FAQ).
THREADS_PER_CORE = 2


def refuse_inf1_inference(instance_type: str) -> None:
    """inf1 (NeuronCore-v1) runs only torch-neuron, built for torch 1.13, and only on drivers this
    SDK's pins no longer include: it is measured in its own environment, never in ours."""
    if instance_type.lower().startswith("inf1."):
        raise UsageError(f"{instance_type}: inf1 runs torch-neuron (torch 1.13), not this environment's torch "
                         f"2.9; measure it with {INF1_BENCH} in the inf1 DLAMI's venv "
                         "/opt/aws_neuron_venv_pytorch_1_13_inf1 (docs/inf1.md)")


def neuron_cores(instance_type: str) -> int | None:
    """NeuronCores of the instance type (the catalog's), None when it is not in the catalog."""
    from neuron_train.cost.catalog import load_catalog

    spec = load_catalog().get(instance_type)
    return spec.cores if spec is not None else None


class InferBench:
    """A forward pass compiled once per batch size and timed in a fixed-shape loop (no gradients)."""

    def __init__(self, cfg: RunConfig, num_classes: int, instance_type: str, workdir: Path):
        import torch

        from neuron_train.common.neuron_env import neuron_device_present
        from neuron_train.training.build import inference_model

        self.cfg, self.torch = cfg, torch
        self.model, self.dtype = inference_model(cfg, num_classes)  # the one plan's inference traces
        self.on_neuron = neuron_device_present()
        # trn1/inf2 only: inf1 (torch-neuron, torch 1.13) is refused before this, see scripts/inf1_bench.py
        self.tracer = "torch-neuronx" if self.on_neuron else "torch-xla"
        self.cores_total = neuron_cores(instance_type) if self.on_neuron else None
        self.threads_per_core = THREADS_PER_CORE
        self.traced: dict[int, str] = {}      # Neuron: one compiled module file per batch size
        self.workdir = workdir                # where the traced modules are saved for the workers
        self.warmed: set[int] = set()          # batch sizes whose graphs are compiled already

    def _input(self, batch: int) -> Tensor:
        img = self.cfg.model.img_size
        # Random images, as in the reference study: the data pipeline is not what is measured.
        return self.torch.randn(batch, 3, img, img, generator=self.torch.Generator().manual_seed(0)
                                ).to(self.dtype)

    def measure(self, batch: int, steps: int, warmup: int) -> Measurement:
        try:
            if self.on_neuron:
                return self._measure_neuron(batch, steps, warmup)
            return self._measure_xla(batch, steps, warmup)
        except (RuntimeError, MemoryError) as exc:
            raise classify_failure(1, f"{type(exc).__name__}: {exc}") from None

    def _timed(self, run_once: Callable[[], object], batch: int, steps: int, warmup: int) -> tuple[float, float]:
        for _ in range(warmup):
            run_once()
        times = []
        start = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            run_once()
            times.append(time.perf_counter() - t)
        total = time.perf_counter() - start
        return batch * steps / total, median_and_spread(times)[0] * 1e3

    def _measure_xla(self, batch: int, steps: int, warmup: int) -> Measurement:
        import torch_xla
        import torch_xla.debug.metrics as met
        import torch_xla.runtime as xr

        from neuron_train.training.build import inference_forward

        device = torch_xla.device()
        model = self.model.to(device)
        x = self._input(batch)
        compiles0 = met.counter_value("UncachedCompile") or 0
        ctime0 = (met.metric_data("CompileTime") or (0, 0, []))[1]

        def run_once() -> Tensor:
            # What a server does, and what the Neuron SDK's harness times when it calls a traced
            # model with host tensors: batch in from the host, logits back to the host.
            out = inference_forward(model, x.to(device), self.cfg.train.precision)
            torch_xla.sync()
            return out.cpu()  # a host read: waits until the device has run the step

        sps, step_ms = self._timed(run_once, batch, steps, 0 if batch in self.warmed else max(warmup, 1))
        self.warmed.add(batch)
        graphs = (met.counter_value("UncachedCompile") or 0) - compiles0
        ctime = ((met.metric_data("CompileTime") or (0, 0, []))[1] - ctime0) / 1e9
        # cast: device_type() is None only while PJRT_DEVICE is unset, and torch_xla.device() above
        # has set it (torch_xla defaults it to CPU)
        return Measurement(sps, step_ms, ctime, graphs, steps, 1, batch, cast(str, xr.device_type()),
                           {"tracer": self.tracer})

    def _measure_neuron(self, batch: int, steps: int, warmup: int) -> Measurement:
        """Neuron hardware (a stand-in torch_neuronx in the tests): compile once in a child process
        that exits before the workers start (core_worker.py says why), then time a copy on every
        core of the instance at once (percore.py), as the Neuron SDK's published figures are made."""
        from neuron_train.cost.bench.percore import instance_figure, run_per_core

        args = _NEURONX_CAST[self.cfg.train.precision]
        dtype = str(self.dtype).removeprefix("torch.")
        compile_s, graphs = 0.0, 0
        if batch not in self.traced:
            start = time.perf_counter()
            self.traced[batch] = self._trace_in_child(batch, dtype, args)
            compile_s, graphs = time.perf_counter() - start, 1
        cores = list(range(self.cores_total or 1))
        worker = [sys.executable, "-m", CORE_WORKER, "run", self.traced[batch], str(batch),
                  str(self.cfg.model.img_size), dtype, str(steps), str(warmup), str(self.threads_per_core)]
        sps, step_ms = instance_figure(run_per_core(worker, cores))
        info: dict[str, str | int] = {"tracer": self.tracer, "compiler_args": " ".join(args),
                                      "threads_per_core": self.threads_per_core}
        if self.cores_total:
            info["cores_total"] = self.cores_total
        return Measurement(sps, step_ms, compile_s, graphs, steps, len(cores), batch * len(cores), "NEURON", info)

    def _trace_in_child(self, batch: int, dtype: str, compiler_args: list[str]) -> str:
        """torch_neuronx.trace in a process that has exited when this returns: the path of the saved
        module. This process never initializes the Neuron runtime, so it holds no NeuronCore."""
        eager = self.workdir / "eager-model.pt"
        if not eager.exists():
            self.torch.save(self.model, eager)
        out = self.workdir / f"traced-b{batch}.pt"
        cmd = [sys.executable, "-m", CORE_WORKER, "trace", str(eager), str(out), str(batch),
               str(self.cfg.model.img_size), dtype, *compiler_args]
        # Its own process group, waited for: it has exited (and released its cores) when run returns.
        ended = proc.run(cmd, dict(os.environ), stdout_too=True, tail_lines=OUTPUT_LINES, echo=False)
        if ended.code != 0 or not out.is_file():
            raise classify_failure(ended.code or 1, "\n".join(ended.tail) or f"{shlex.join(cmd)} wrote no {out}")
        return str(out)
