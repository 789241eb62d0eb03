#!/usr/bin/env python3
"""Benchmark: what the lazy step costs the host, per optimizer implementation, side by side.

On the lazy step path (Neuron's default) Python traces every op of forward, backward, clipping and
the optimizer into torch_xla's IR each step; if that takes longer than the device's step, the
NeuronCores wait. This runs our loop's own step (training.loop.Trainer.train_step) on the lazy path
and reports, per step:

- trace ms: the tracing threads' CPU time (the calling thread's, plus autograd's device thread that
  traces the backward) from the step's first op to the point where it is cut into a graph, with the
  device idle (the previous step has finished): tracing alone, and robust to load;
- other ms: the rest of the process's CPU time meanwhile (XLA's and PJRT's own threads). On the
  full-width ViT-B/16 these threads are still busy with the previous step after its ExecuteTime
  ended (70-90 ms with the flat update: its graph has more and larger buffers to release); with
  `--settle 1` that work ends before the trace and `other ms` falls to ~2 ms while `trace ms` stays:
  it runs beside the tracing thread, not on it (docs/measurements.md);
- sync ms: host CPU time of the cut itself (torch_xla.sync: the graph's hash, cache look-up, launch),
  the calling thread's (the graph starts executing on XLA's own threads during the call);
- IR nodes: the traced graph's size (torch_xla's TensorsGraphSize metric);
- HLO: instructions of the step's graph as lowered (what `plan` counts);
- device ms: XLA's ExecuteTime of the step.

Models: ViT-Tiny/16, ViT-B/16 (also at width 96: the same ops, see MODELS) and a BERT-Large-like
encoder (24 pre-norm blocks of 16 heads, width 64: the op count of BERT-Large's layers, not its
FLOPs) at 32 px (the op count does not depend on the image size). `for-loop` is the step as it was
before the flat update (torch's per-tensor AdamW, what Neuron's samples run); the last column is each
row's trace time against it. Every configuration runs in a fresh process (clean metrics and caches);
repeats are interleaved and the table shows medians, so a busy machine slows every row alike.

    python scripts/bench_trace.py                                  # every model, fp32 and bf16-autocast
    python scripts/bench_trace.py --models vit-b16,bert-large-like --impls for-loop,flat --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
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
FIGURES = ("trace_ms", "other_ms", "sync_ms", "ir_nodes", "hlo_instructions", "device_ms")


def _thread_cpu_ns() -> dict[int, tuple[str, int]]:
    """CPU time (ns) of every thread of this process so far: {thread id: (name, ns)} (Linux schedstat)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
        out[int(tid)] = (name, ns)
    return out


def _tracing_ms(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> float:
    """The tracing threads' CPU ms between two `_thread_cpu_ns` snapshots: this thread's, and torch's
    autograd worker's for the XLA device (`pt_autograd_N`, which runs the backward's ops). Every other
    thread is XLA's or PJRT's."""
    me = threading.get_native_id()
    return sum(ns - before.get(tid, (name, 0))[1] for tid, (name, ns) in after.items()
               if tid == me or name.startswith("pt_autograd")) / 1e6


def _live_outputs(trainer) -> list:
    """The tensors a step leaves pending: what the step writes (StepPath.state), the logged loss and norm."""
    losses, grad_norm = trainer.live
    return [*trainer.step_path.state(), *losses.values(), grad_norm]


def one(model: str, impl: str, precision: str, steps: int, warmup: int, settle: float) -> dict:
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
            time.sleep(settle)  # --settle: XLA's threads finish the previous step's leftovers first
            t0, before = time.process_time(), _thread_cpu_ns()
            trainer.train_step(iter([(images, labels)]))
            after, t1 = _thread_cpu_ns(), time.process_time()
            trace_ms = _tracing_ms(before, after)
            hlo = hlo_figures(torch_xla._XLAC._get_xla_tensors_hlo(_live_outputs(trainer)))
            met.clear_all()
            t2 = time.thread_time()  # this thread's alone: the graph executes on XLA's threads meanwhile
            torch_xla.sync()  # the step's cut, as MpDeviceLoader makes it at the next batch
            t3 = time.thread_time()
            xm.wait_device_ops()  # for the step's ExecuteTime
            if step >= warmup:
                sizes, execute = met.metric_data("TensorsGraphSize"), met.metric_data("ExecuteTime")
                rows.append({"trace_ms": trace_ms, "other_ms": (t1 - t0) * 1e3 - trace_ms, "sync_ms": (t3 - t2) * 1e3,
                             "ir_nodes": sizes[2][-1][1] if sizes else 0, "hlo_instructions": hlo.instructions,
                             "device_ms": execute[1] / 1e6 if execute else 0.0})
            xm.mark_step()
    return {k: statistics.median(r[k] for r in rows) for k in FIGURES}


def run_child(model: str, impl: str, precision: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--_one", model, impl, precision, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--settle", str(args.settle)]
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{model} {impl} {precision} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_table(results: dict[tuple[str, str, str], list[dict]], baseline: str) -> None:
    print(f"{'model':<16}{'precision':<15}{'optimizer':<10}{'trace ms':>10}{'other ms':>10}{'sync ms':>9}"
          f"{'IR nodes':>10}{'HLO':>8}{'device ms':>11}{'trace vs ' + baseline:>20}")
    med = {key: {k: statistics.median(r[k] for r in runs) for k in FIGURES} for key, runs in results.items()}
    for (model, precision, impl), m in med.items():
        base = med.get((model, precision, baseline))
        ratio = f"{m['trace_ms'] / base['trace_ms']:.2f}x" if base else "-"
        print(f"{model:<16}{precision:<15}{impl:<10}{m['trace_ms']:>10.1f}{m['other_ms']:>10.1f}"
              f"{m['sync_ms']:>9.1f}{m['ir_nodes']:>10.0f}{m['hlo_instructions']:>8.0f}{m['device_ms']:>11.1f}{ratio:>20}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--impls", default=",".join(IMPLS), help="optimizer implementations: " + ", ".join(IMPLS))
    p.add_argument("--precisions", default=",".join(PRECISIONS), help=", ".join(PRECISIONS))
    p.add_argument("--steps", type=int, default=5, help="measured steps (median) per process")
    p.add_argument("--warmup", type=int, default=3, help="steps left out (compiles happen here)")
    p.add_argument("--repeats", type=int, default=1, help="processes per configuration, interleaved")
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds to wait before each step once the device is idle (then `other ms` shows "
                        "whether XLA's threads were still busy with the previous step)")
    p.add_argument("--_one", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._one:
        print(json.dumps(one(*args._one, steps=args.steps, warmup=args.warmup, settle=args.settle)))
        return
    impls = args.impls.split(",")
    keys = [(m, pr, i) for m in args.models.split(",") for pr in args.precisions.split(",") for i in impls]
    results: dict[tuple[str, str, str], list[dict]] = {k: [] for k in keys}
    for _ in range(args.repeats):
        for model, precision, impl in keys:
            results[(model, precision, impl)].append(run_child(model, impl, precision, args))
    print_table(results, impls[0])
    print(f"medians of {args.repeats} process(es) x {args.steps} steps; CPU time with the device idle: trace = the "
          "tracing threads', other = the process's other threads' meanwhile")


if __name__ == "__main__":
    main()
