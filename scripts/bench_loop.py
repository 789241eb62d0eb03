#!/usr/bin/env python3
"""Benchmark: our training loop against a plain hand-written torch_xla loop, side by side.

Both train the same timm model on the same synthetic batches (one process at a time, on the current
XLA device) and are timed the same way: after warm-up steps, from an idle device to an idle device.
Printed per run: samples/s, wall ms/step, XLA's own ExecuteTime per step, and wall / ExecuteTime,
i.e. how much host time a loop adds on top of the device's execution.

    python scripts/bench_loop.py                       # ViT-Tiny/16 at 64 px, batch 32, fp32
    python scripts/bench_loop.py --model vit-micro --img-size 32 --steps 60 --repeats 3
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
LOOPS = ("baseline", "ours-lazy", "ours-dynamo")


def baseline(args: argparse.Namespace) -> dict:
    """The hand-written loop a torch_xla user writes first: MpDeviceLoader + xm.optimizer_step + Adam."""
    import torch
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.parallel_loader as pl

    from neuron_train.training.data import SyntheticDataset
    from neuron_train.training.models import create_model

    torch.manual_seed(0)
    dev = torch_xla.device()
    model = create_model(args.model, num_classes=1000, img_size=args.img_size).to(dev).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    ds = SyntheticDataset(args.batch_size * (args.steps + args.warmup), args.img_size, 1000)
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, drop_last=True, num_workers=2)
    t0 = None
    for step, (x, y) in enumerate(pl.MpDeviceLoader(loader, dev)):
        if step == args.warmup:
            torch_xla.sync()
            xm.wait_device_ops()
            met.clear_all()
            t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        xm.optimizer_step(opt)
    torch_xla.sync()
    xm.wait_device_ops()
    wall = time.perf_counter() - t0
    count, total_ns, _ = met.metric_data("ExecuteTime")
    return {"samples_per_sec": args.steps * args.batch_size / wall, "wall_ms": wall / args.steps * 1e3,
            "execute_ms": total_ns / 1e6 / args.steps, "executions": count}


def ours(args: argparse.Namespace, step_compiler: str) -> dict:
    """Our loop (neuron_train.training.loop.Trainer) with its defaults: AdamW, clipping, LR schedule, logging."""
    import torch_xla.debug.metrics as met

    from neuron_train.training.config import build_config
    from neuron_train.training.device import init_backend, prepare_environment

    with tempfile.TemporaryDirectory() as out:
        cfg = build_config(overrides={
            "model.name": args.model, "model.img_size": args.img_size, "model.num_classes": 1000,
            "data.dataset": "synthetic", "data.synthetic_size": args.batch_size * (args.steps + args.warmup),
            "train.batch_size": args.batch_size, "train.max_steps": args.steps + args.warmup,
            "train.warmup_measure_steps": args.warmup, "train.eval_every": 10**9,
            "train.output_dir": out, "train.step_compiler": step_compiler,
            "log.progress": False, "log.tensorboard": False,
        })
        prepare_environment(cfg.train.precision)
        from neuron_train.training.loop import Trainer

        trainer = Trainer(cfg, init_backend())
        trainer.evaluator.val = None  # time training only, like the baseline
        # ExecuteTime over the measured steps only: clear the metrics when measuring starts.
        original = trainer.train_step

        def step(batches):
            if trainer.pos.step == args.warmup:
                met.clear_all()
            original(batches)

        trainer.train_step = step
        s = trainer.run()
    count, total_ns, _ = met.metric_data("ExecuteTime")
    return {"samples_per_sec": s["samples_per_sec"], "wall_ms": 1e3 * args.batch_size / s["samples_per_sec"],
            "execute_ms": total_ns / 1e6 / args.steps, "executions": count}


def run_one(which: str, args: argparse.Namespace) -> dict:
    """Each measurement in a fresh process: clean metrics, compile caches and memory."""
    cmd = [sys.executable, __file__, "--_one", which, "--model", args.model, "--img-size",
           str(args.img_size), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{which} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_tiny_patch16_224")
    p.add_argument("--img-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=40, help="measured steps")
    p.add_argument("--warmup", type=int, default=5, help="steps left out (compiles happen here)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each loop, interleaved")
    p.add_argument("--_one", choices=LOOPS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._one:
        which = args._one
        print(json.dumps(baseline(args) if which == "baseline" else ours(args, which.split("-")[1])))
        return
    print(f"{args.model} at {args.img_size} px, batch {args.batch_size}, fp32, {args.steps} measured "
          f"steps after {args.warmup} warm-up, device {os.environ.get('PJRT_DEVICE', 'CPU')}")
    results: dict[str, list[dict]] = {which: [] for which in LOOPS}
    for _ in range(args.repeats):
        for which in results:
            results[which].append(run_one(which, args))
    print(f"{'loop':<13}{'samples/s':>11}{'wall ms/step':>14}{'ExecuteTime ms/step':>21}{'wall/exec':>11}"
          f"{'vs baseline':>13}")
    med = {}
    for which, runs in results.items():
        med[which] = {k: statistics.median(r[k] for r in runs) for k in ("samples_per_sec", "wall_ms", "execute_ms")}
        m = med[which]
        ratio = m["samples_per_sec"] / med["baseline"]["samples_per_sec"]
        print(f"{which:<13}{m['samples_per_sec']:>11.1f}{m['wall_ms']:>14.1f}{m['execute_ms']:>21.1f}"
              f"{m['wall_ms'] / m['execute_ms']:>11.3f}{ratio:>12.3f}x")
    print(f"medians of {args.repeats} interleaved runs each; ExecuteTime summed over a step's executions")


if __name__ == "__main__":
    main()
