#!/usr/bin/env python3
"""Benchmark: what the lazy step costs the host, per optimizer implementation, side by side.

On the lazy step path (Neuron's default) Python traces every op of forward, backward, clipping and
the optimizer into torch_xla's IR each step; if that takes longer than the device's step, the
NeuronCores wait. This runs our loop's own step (training.loop.Trainer.train_step) on the lazy path
and reports, per step:

- trace ms: host CPU time (the process's, so autograd's backward thread counts) from the step's
  first op to the point where it is cut into a graph, with the device idle (the previous step has
  finished), so the figure is tracing alone;
- sync ms: host CPU time of the cut itself (torch_xla.sync: the graph's hash, cache look-up, launch),
  the calling thread's (the graph starts executing on XLA's own threads during the call);
- IR nodes: the traced graph's size (torch_xla's TensorsGraphSize metric);
- HLO: instructions of the step's graph as lowered (what `plan` counts);
- device ms: XLA's ExecuteTime of the step.

Models: ViT-Tiny/16, ViT-B/16 (also at width 96: the same ops, see MODELS) and a BERT-Large-like
encoder (24 pre-norm blocks of 16 heads, width 64: the op count of BERT-Large's layers, not its
FLOPs) at 32 px (the op count does not depend on the image size). Every configuration runs in a
fresh process (clean metrics and caches); repeats are interleaved and the table shows medians, so a
busy machine slows every row alike.

    python scripts/bench_trace.py                                  # every model, fp32 and bf16-autocast
    python scripts/bench_trace.py --models vit-b16 --impls for-loop,flat --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "vit-tiny": dict(model="vit_tiny_patch16_224"),
    "vit-b16": dict(model="vit_base_patch16_224"),
    # ViT-B/16's blocks and heads at width 96: its op count without the CPU device's cost of freeing
    # the previous step's 86 M-parameter buffers, which lands in the host's time on this device
    "vit-b16-narrow": dict(model="vit_base_patch16_224", embed_dim=96),
    "bert-large-like": dict(model="vit_base_patch16_224", embed_dim=64, depth=24, num_heads=16),
}
IMPLS = ("for-loop", "foreach", "flat")
PRECISIONS = ("fp32", "bf16-autocast")
FIGURES = ("trace_ms", "sync_ms", "ir_nodes", "hlo_instructions", "device_ms")


def _live_outputs(trainer) -> list:
    """The tensors a step leaves pending: what the step writes (StepPath.state), the logged loss and norm."""
    losses, grad_norm = trainer.live
    return [*trainer.step_path.state(), *losses.values(), grad_norm]


def one(model: str, impl: str, precision: str, steps: int, warmup: int) -> dict:
    """Measure in this process (a child of `main`)."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from neuron_train.cost.plan.hlo import hlo_figures
    from neuron_train.training import models
    from neuron_train.training.config_io import build_config
    from neuron_train.training.device import init_backend, resolve_precision
    from neuron_train.training.loop import Trainer

    models.PRESETS[model] = dict(MODELS[model], patch_size=16)
    batch = 2
    with tempfile.TemporaryDirectory() as out:
        cfg = resolve_precision(build_config(overrides={
            "model.name": model, "model.img_size": 32, "model.num_classes": 10, "data.dataset": "synthetic",
            "data.synthetic_size": batch, "train.batch_size": batch, "train.max_steps": 1000,
            "train.output_dir": out, "log.progress": False, "log.tensorboard": False, "data.num_workers": 0,
            "train.step_compiler": "lazy", "optim.optimizer_impl": impl, "train.precision": precision}))
        trainer = Trainer(cfg, init_backend())
        dev = trainer.backend.device
        images = torch.randn(batch, 3, 32, 32).to(dev)
        labels = torch.randint(0, 10, (batch,)).to(dev)
        torch_xla.sync()  # the batch is on the device before the first step
        rows = []
        for step in range(warmup + steps):
            trainer.pos.step = step
            xm.wait_device_ops()  # the device is idle: the CPU time below is the host's alone
            t0 = time.process_time()
            trainer.train_step(iter([(images, labels)]))
            t1 = time.process_time()
            hlo = hlo_figures(torch_xla._XLAC._get_xla_tensors_hlo(_live_outputs(trainer)))
            met.clear_all()
            t2 = time.thread_time()  # this thread's alone: the graph executes on XLA's threads meanwhile
            torch_xla.sync()  # the step's cut, as MpDeviceLoader makes it at the next batch
            t3 = time.thread_time()
            xm.wait_device_ops()  # for the step's ExecuteTime
            if step >= warmup:
                sizes, execute = met.metric_data("TensorsGraphSize"), met.metric_data("ExecuteTime")
                rows.append({"trace_ms": (t1 - t0) * 1e3, "sync_ms": (t3 - t2) * 1e3,
                             "ir_nodes": sizes[2][-1][1] if sizes else 0, "hlo_instructions": hlo.instructions,
                             "device_ms": execute[1] / 1e6 if execute else 0.0})
            xm.mark_step()
    return {k: statistics.median(r[k] for r in rows) for k in FIGURES}


def run_child(model: str, impl: str, precision: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--_one", model, impl, precision, "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{model} {impl} {precision} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_table(results: dict[tuple[str, str, str], list[dict]], baseline: str) -> None:
    print(f"{'model':<16}{'precision':<15}{'optimizer':<10}{'trace ms':>10}{'sync ms':>9}{'IR nodes':>10}"
          f"{'HLO':>8}{'device ms':>11}{'trace vs ' + baseline:>20}")
    med = {key: {k: statistics.median(r[k] for r in runs) for k in FIGURES} for key, runs in results.items()}
    for (model, precision, impl), m in med.items():
        base = med.get((model, precision, baseline))
        ratio = f"{m['trace_ms'] / base['trace_ms']:.2f}x" if base else "-"
        print(f"{model:<16}{precision:<15}{impl:<10}{m['trace_ms']:>10.1f}{m['sync_ms']:>9.1f}"
              f"{m['ir_nodes']:>10.0f}{m['hlo_instructions']:>8.0f}{m['device_ms']:>11.1f}{ratio:>20}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--impls", default=",".join(IMPLS), help="optimizer implementations: " + ", ".join(IMPLS))
    p.add_argument("--precisions", default=",".join(PRECISIONS), help=", ".join(PRECISIONS))
    p.add_argument("--steps", type=int, default=5, help="measured steps (median) per process")
    p.add_argument("--warmup", type=int, default=3, help="steps left out (compiles happen here)")
    p.add_argument("--repeats", type=int, default=1, help="processes per configuration, interleaved")
    p.add_argument("--_one", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._one:
        print(json.dumps(one(*args._one, steps=args.steps, warmup=args.warmup)))
        return
    impls = args.impls.split(",")
    keys = [(m, pr, i) for m in args.models.split(",") for pr in args.precisions.split(",") for i in impls]
    results: dict[tuple[str, str, str], list[dict]] = {k: [] for k in keys}
    for _ in range(args.repeats):
        for model, precision, impl in keys:
            results[(model, precision, impl)].append(run_child(model, impl, precision, args))
    print_table(results, impls[0])
    print(f"medians of {args.repeats} process(es) x {args.steps} steps; host CPU time with the device idle")


if __name__ == "__main__":
    main()
