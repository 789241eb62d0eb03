"""What `neuron-train plan` measures on this machine: one process's steady training (or inference)
step of our loop or of any script, as `WorkloadFigures` for the estimate (plan_model.py).

- our loop (`measure_loop`): a few real steps on the CPU XLA device in this process; FLOPs and bytes
  from the HLO of a steady step's pending graph; host time split into the input pipeline (CPU
  seconds per batch, drawn without workers) and the rest (tracing + dispatch until the sync);
  activations = the bytes autograd saves for the backward.
- a model too large for this machine (`from_shapes`): the same figures counted on the meta device
  (torch's FLOP counter, nothing allocated, no host time): an estimate from shapes.
- any script (`measure_script`): the command runs under bench's probe with XLA's HLO dump on; the
  graph with the most dot/convolution FLOPs is its step.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Sized
from pathlib import Path
from typing import Any, cast

from neuron_train.common.errors import RunError
from neuron_train.cost.plan_hlo import HloFigures, hlo_figures
from neuron_train.cost.plan_model import WorkloadFigures

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_STATES = 2              # AdamW's two moments per parameter (SGD with momentum: 1)


def matmul_precision(precision: str) -> str:
    """What the matrix units run for one of our --precision values (fp32: --auto-cast none)."""
    return "fp32" if precision == "fp32" else "bf16"


def _weights_bytes(n_params: int, precision: str) -> int:
    return n_params * (2 if precision in ("bf16", "xla-use-bf16", "xla-downcast-bf16") else 4)


def _optimizer_states(name: str) -> int:
    return 1 if name == "sgd" else ADAM_STATES


def _saved_bytes(model, run_forward) -> tuple[float, Any]:
    """Bytes autograd saves for the backward during one forward (activations; weights excluded),
    and the forward's output."""
    import torch

    params = {id(p) for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if id(t) not in params:
            seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_forward()
    return float(sum(seen.values())), out


def _input_seconds(loader, batches: int) -> float:
    """CPU seconds per batch of the input pipeline, drawn in this process (no workers)."""
    it = iter(loader)
    next(it)  # the first batch pays for start-up
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return (time.perf_counter() - start) / batches


def _loader_pair(cfg, data):
    """The loop's train loader, and the same data drawn without workers (to time the pipeline)."""
    from neuron_train.training.data import train_loader

    kw = dict(batch_size=cfg.train.batch_size, accum=1, world=1, rank=0, seed=cfg.train.seed, epoch=0)
    return (train_loader(data.train, cfg.data, **kw),
            train_loader(data.train, dataclasses.replace(cfg.data, num_workers=0), **kw))


def _step_fn(model, mode: str, precision: str):
    """One step as our loop traces it (train: forward, loss, backward, AdamW/SGD update; infer: a
    forward without gradients), returning (output tensors of the step, activation bytes)."""
    import torch

    from neuron_train.training.step import autocast

    loss_fn = torch.nn.CrossEntropyLoss()

    def step(images, labels, optimizer):
        if mode == "infer":
            with torch.no_grad(), autocast(precision):
                return [model(images)], 0.0
        with autocast(precision):
            activations, logits = _saved_bytes(model, lambda: model(images))
            loss = loss_fn(logits.float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return [loss, *model.parameters(), *state], activations
    return step


def measure_loop(cfg, mode: str = "train", steps: int = 3) -> tuple[WorkloadFigures, dict]:
    """Our loop's model, data and optimizer: `steps` steps on the XLA device (>= 2: the first
    creates the optimizer state), the last one measured. Returns the figures and details."""
    import torch_xla

    from neuron_train.training.data import build_datasets
    from neuron_train.training.models import build_model
    from neuron_train.training.optim import build_optimizer

    data = build_datasets(cfg.data, cfg.model.img_size, cfg.model.num_classes, cfg.train.seed)
    device = torch_xla.device()
    model = build_model(cfg.model.name, num_classes=data.num_classes, img_size=cfg.model.img_size).to(device)
    model.train(mode == "train")
    optimizer = build_optimizer(model, cfg.optim) if mode == "train" else None
    loader, no_workers = _loader_pair(cfg, data)
    host_input = _input_seconds(no_workers, 3)
    step, traced, batches = _step_fn(model, mode, cfg.train.precision), [], iter(loader)
    for i in range(max(steps, 2)):
        images, labels = (t.to(device) for t in next(batches))
        start = time.perf_counter()
        outputs, activations = step(images, labels, optimizer)
        if i == max(steps, 2) - 1:  # the steady step's graph, read before the sync runs it
            hlo = hlo_figures(torch_xla._XLAC._get_xla_tensors_hlo(outputs))
        traced.append(time.perf_counter() - start)
        # Sync point: one step is one graph, as in our loop; then a host read waits for the device,
        # so the next step's tracing time is not mixed with this step's execution.
        torch_xla.sync()
        outputs[0].cpu()
    n = sum(p.numel() for p in model.parameters())
    train = mode == "train"
    weights = _weights_bytes(n, cfg.train.precision)
    figures = WorkloadFigures(
        name=cfg.model.name, mode=mode, flops_per_step=hlo.flops,
        precision=matmul_precision(cfg.train.precision), bytes_per_step=hlo.bytes_in + hlo.bytes_out,
        samples_per_step=cfg.train.batch_size, param_bytes=weights, grad_bytes=weights if train else 0.0,
        optimizer_bytes=n * 4 * _optimizer_states(cfg.optim.optimizer) if train else 0.0,
        activation_bytes=activations, host_input_s=host_input, host_rest_s=statistics.median(traced[1:]),
        loader_workers=cfg.data.workers(), measured_by="measured on the CPU XLA device of this machine")
    return figures, {"parameters": n, "num_classes": data.num_classes, "train_samples": len(cast(Sized, data.train)),
                     "hlo": {"dots": hlo.dots, "convolutions": hlo.convolutions,
                             "flops_by_dtype": hlo.flops_by_dtype}}


def from_shapes(cfg, mode: str = "train") -> tuple[WorkloadFigures, dict]:
    """Our loop's model counted on the meta device: FLOPs of forward + backward (torch's counter),
    weights, gradients, optimizer state and activations from shapes; nothing is allocated and no
    host time is known (the host side is then assumed not to be the bottleneck)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from neuron_train.training.models import build_model

    with torch.device("meta"):
        model = build_model(cfg.model.name, num_classes=cfg.model.num_classes, img_size=cfg.model.img_size)
        images = torch.empty(cfg.train.batch_size, 3, cfg.model.img_size, cfg.model.img_size)
    train = mode == "train"
    with FlopCounterMode(display=False) as counter:
        activations, logits = _saved_bytes(model, lambda: model(images))
        if train:
            logits.float().sum().backward()
    n = sum(p.numel() for p in model.parameters())
    weights = _weights_bytes(n, cfg.train.precision)
    figures = WorkloadFigures(
        name=cfg.model.name, mode=mode, flops_per_step=float(counter.get_total_flops()),
        precision=matmul_precision(cfg.train.precision), bytes_per_step=(3.0 if train else 1.0) * weights,
        samples_per_step=cfg.train.batch_size, param_bytes=weights, grad_bytes=weights if train else 0.0,
        optimizer_bytes=n * 4 * _optimizer_states(cfg.optim.optimizer) if train else 0.0,
        activation_bytes=activations if train else 0.0,
        measured_by="estimated from shapes on the meta device (nothing allocated; host time not measured)")
    return figures, {"parameters": n, "num_classes": cfg.model.num_classes, "train_samples": None}


def steady_graph(dump_dir: Path) -> tuple[HloFigures, int]:
    """The dumped graph with the most dot/convolution FLOPs (a script's step), and how many graphs."""
    texts = sorted(dump_dir.rglob("*before_optimizations.txt"))
    figures = [hlo_figures(p.read_text(errors="replace")) for p in texts]
    best = max(figures, key=lambda f: f.flops, default=HloFigures())
    return best, len(figures)


def measure_script(command: list[str], *, steps: int, samples_flag: int | None, mode: str,
                   name: str | None) -> tuple[WorkloadFigures, dict]:
    """Run the command under bench's probe with the HLO dump on; one process's step figures."""
    from neuron_train.cost import script_bench
    from neuron_train.instrument.script import require_ran, run_script

    with tempfile.TemporaryDirectory(prefix="neuron-train-plan-") as folder:
        dump = Path(folder) / "hlo"
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip()
        run = run_script(command, Path(folder), mode="bench", steps=steps, extra_env={"XLA_FLAGS": flags}, echo=False)
        require_ran(run, "nothing was measured", stopped_ok=("bench",))
        hlo, graphs = steady_graph(dump)
    if hlo.flops <= 0:
        raise RunError(f"{run.line}: no graph with a matrix multiply or convolution was compiled: nothing to "
                       "estimate (does the command train a model on the XLA device?)")
    f = script_bench.figures(run, samples_flag)
    n = f.parameters
    legacy_bf16 = os.environ.get("XLA_USE_BF16") == "1" or os.environ.get("XLA_DOWNCAST_BF16") == "1"
    weights = n * (2 if legacy_bf16 else 4)
    cast = os.environ.get("NEURON_CC_FLAGS", "").replace("=", " ")
    precision = hlo.precision if "--auto-cast none" in cast else "bf16"   # neuronx-cc's default: matmult in bf16
    figures = WorkloadFigures(
        name=name or script_bench.script_name(command), mode=mode, flops_per_step=hlo.flops, precision=precision,
        bytes_per_step=hlo.bytes_in + hlo.bytes_out, samples_per_step=f.samples_per_step,
        param_bytes=weights, grad_bytes=weights if mode == "train" else 0.0,
        optimizer_bytes=n * 4 * ADAM_STATES if mode == "train" else 0.0, activation_bytes=0.0,
        # The host's share of a step: wall time minus the CPU device's execution, as one figure (a
        # COMMAND's input pipeline is not told apart from its tracing).
        host_rest_s=f.host_step_s,
        measured_by="measured on the CPU XLA device of this machine (a COMMAND: host time as one figure, "
                    "wall minus execution; activations not counted)")
    return figures, {"parameters": n or None, "cpu_samples_per_sec": f.samples_per_sec,
                     "cpu_host_ms_per_step": round(f.host_step_s * 1e3, 3), "graphs_dumped": graphs,
                     "batch_shape": f.batch_shape, "step_site": f.site, "world_size": f.world_size,
                     "hlo": {"dots": hlo.dots, "convolutions": hlo.convolutions,
                             "flops_by_dtype": hlo.flops_by_dtype}}
