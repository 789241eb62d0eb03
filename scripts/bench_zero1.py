"""ZeRO-1: optimizer memory per rank, step time, and equality with plain data parallelism.

    python scripts/bench_zero1.py [--model vit-micro] [--steps 20] [--worlds 1 2] [--precision fp32]
                                  [--out DIR] [-- extra train flags]

For each world size, the same run (seed, global batch, steps) without and with --zero1. Prints the
optimizer bytes each rank holds (moments and step counts; ZeRO-1's f32 master copy of its weight
shard), the median step time, and the largest weight difference between the two runs' final
checkpoints. On CPU, world size 2 runs ZeRO-1 over the gloo bridge (GlooZero1); world size 1 runs
torch_xla's ZeroRedundancyOptimizer itself.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from bench_runs import load_note, split_passthrough, train

from neuron_train.training.checkpoint import list_checkpoints


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    argv, extra = split_passthrough(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit-micro", help="model (preset or timm name)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--global-batch", type=int, default=32, help="samples per step over all ranks")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="data-parallel world sizes")
    p.add_argument("--precision", default="fp32", help="--precision of every run")
    p.add_argument("--out", type=Path, default=Path(f"runs/bench-zero1-{time.strftime('%Y%m%d-%H%M%S')}"),
                   help="directory for all runs (must not exist)")
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"{args.out} exists: choose another --out (results are never overwritten)")
    bad = [w for w in args.worlds if w < 1 or args.global_batch % w]
    if bad:
        p.error(f"--global-batch {args.global_batch} does not split over world sizes {bad}")
    return args, extra


def final_weights(run_dir: Path) -> dict:
    return torch.load(list_checkpoints(run_dir)[-1], weights_only=True)["model"]


def largest_difference(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def mb(values: list[int]) -> str:
    return "/".join(f"{v / 2**20:.2f}" for v in values)


def main(argv: list[str]) -> int:
    args, extra = parse_args(argv)
    print(f"# ZeRO-1 benchmark: {args.model}, {args.precision}, global batch {args.global_batch}, "
          f"{args.steps} steps; {load_note()}", flush=True)
    rows = []
    for world in args.worlds:
        common = ["--model", args.model, "--precision", args.precision, "--max-steps", str(args.steps),
                  "--batch-size", str(args.global_batch // world), "--eval-every", "100000", *extra]
        runs = {}
        for zero1 in (False, True):
            label = f"world {world}{' zero1' if zero1 else ''}"
            out = args.out / f"w{world}-{'zero1' if zero1 else 'plain'}"
            runs[zero1] = (out, train(out, [*common, *(["--zero1"] if zero1 else [])], label, nproc=world))
        diff = largest_difference(final_weights(runs[True][0]), final_weights(runs[False][0]))
        for zero1 in (False, True):
            s = runs[zero1][1].summary
            rows.append((world, zero1, s, diff if zero1 else None))

    print(f"\n{'world':>5} {'zero1':>5} {'optimizer state MiB/rank':>25} {'master weights MiB/rank':>24} "
          f"{'step ms':>8} {'samples/s':>10} {'max |dw| vs plain':>18}")
    for world, zero1, s, diff in rows:
        step = s["step_time_ms_median"]
        rate = s["samples_per_sec"]
        print(f"{world:>5} {'yes' if zero1 else 'no':>5} {mb(s['optimizer_state_bytes_per_rank']):>25} "
              f"{mb(s['master_weight_bytes_per_rank']):>24} {step if step is None else format(step, '.1f'):>8} "
              f"{rate if rate is None else format(rate, '.1f'):>10} "
              f"{'' if diff is None else format(diff, '.2e'):>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
