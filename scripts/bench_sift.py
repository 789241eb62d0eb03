"""Does loss-based sifting pay off? Time and samples back-propagated to reach a target accuracy.

    python scripts/bench_sift.py [--target 0.85] [--epochs 8] [--keep 0.5] [--out DIR] [-- flags]

Trains the same model with the same seed on the digits data twice, without and with sifting
(--sift topk --sift-keep KEEP, after --sift-delay steps), evaluating every --eval-every steps, and
prints side by side: the first evaluation at or above the target (its step, the wall time since
launch, the training time without compilation = steps x median step time (full-batch steps at
the unsifted run's), the samples back-propagated until then) and the final accuracy. Pass
--relative BETA to add a run with the relative-probabilistic rule.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench_runs import Run, load_note, train


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit-digits")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--target", type=float, default=0.85, help="validation accuracy to reach")
    p.add_argument("--keep", type=float, default=0.5, help="--sift-keep of the topk run")
    p.add_argument("--relative", type=float, default=None, metavar="BETA",
                   help="also run --sift relative --sift-beta BETA")
    p.add_argument("--delay", type=int, default=46, help="--sift-delay (default: one epoch)")
    p.add_argument("--eval-every", type=int, default=23)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(f"runs/bench-sift-{time.strftime('%Y%m%d-%H%M%S')}"),
                   help="directory for all runs (must not exist)")
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"{args.out} exists: choose another --out (results are never overwritten)")
    if not 0 < args.target <= 1:
        p.error("--target must be in (0, 1]")
    return args, extra


def full_steps(step: int, summary: dict, delay: int) -> int:
    """How many of the first `step` steps trained on full batches."""
    return min(step, delay) if "sift" in summary else step


def report(name: str, run: Run, full_step_ms: float, args: argparse.Namespace) -> str:
    """One row. Full-batch steps are costed at the unsifted run's median step time, sifted ones
    at this run's (its median is a sifted step when most steps are sifted)."""
    s = run.summary
    hit = run.first_reaching(args.target)
    step_ms = s["step_time_ms_median"]
    if hit is None:
        reach = f"{'not reached':>40}"
    else:
        full = full_steps(hit.step, s, args.delay)
        train_s = (full * full_step_ms + (hit.step - full) * step_ms) / 1e3
        kept = s.get("sift_kept_per_batch", args.batch_size)
        samples = full * args.batch_size + (hit.step - full) * kept
        reach = f"{hit.step:>6} {hit.wall_s:>8.1f} s {train_s:>8.1f} s {samples:>9}"
    return (f"{name:<22} {reach}   {s['eval_accuracy']:.3f}   {step_ms:>6.1f} ms  "
            f"{s.get('backprop_fraction') or 1.0:.2f}  {s['compile_count']}")


def main(argv: list[str]) -> int:
    args, extra = parse_args(argv)
    print(f"start: {load_note()}", flush=True)
    common = ["--model", args.model, "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
              "--eval-every", str(args.eval_every), "--seed", str(args.seed), *extra]
    sifting = ["--sift-delay", str(args.delay)]
    runs = {"no sifting": train(args.out / "full", common, "no sifting")}
    runs[f"topk keep {args.keep}"] = train(args.out / "topk", [*common, "--sift", "topk", "--sift-keep",
                                                              str(args.keep), *sifting], "topk")
    if args.relative is not None:
        runs[f"relative beta {args.relative}"] = train(
            args.out / "relative", [*common, "--sift", "relative", "--sift-beta", str(args.relative),
                                    *sifting], "relative")
    print(f"\nend: {load_note()}")
    print(f"\n{args.model} on digits, {args.epochs} epochs, batch {args.batch_size}, seed {args.seed}, "
          f"sift delay {args.delay} steps; first evaluation (every {args.eval_every} steps) with "
          f"accuracy >= {args.target}:")
    print(f"{'run':<22} {'step':>6} {'wall':>10} {'train':>10} {'backprop':>9}   final   "
          f"{'step':>9}  kept  graphs")
    full_step_ms = runs["no sifting"].summary["step_time_ms_median"]
    for name, run in runs.items():
        print(report(name, run, full_step_ms, args))
    print("wall: since launch (start-up, compilation, evaluations included); train: steps x median "
          "step time; backprop: samples back-propagated; kept: fraction back-propagated overall")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
