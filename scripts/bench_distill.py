"""Does distillation pay off? Teacher, student alone and distilled student on the digits data.

    python scripts/bench_distill.py [--epochs 20] [--seeds 0 1 2] [--out DIR] [-- extra train flags]

Trains the teacher once (or takes --teacher-checkpoint), then for each seed the student alone and
the same student distilled from the teacher: same epochs, same seed (same initial weights and data
order), so the teacher's soft targets are the only difference. Prints the accuracies and parameter
counts side by side. The validation set has 300 images (one image = 0.33 points of accuracy), so
compare means over several seeds, not single runs.

Defaults, and why: the teacher is vit-micro (1.8 M parameters, 3.9x the vit-digits student), not
vit-digits-teacher (2.7 M, patch 4): on a CPU the latter costs ~8x a student step and at 8 epochs
learned slower than the student (0.853). 20 epochs trains both to convergence; at 8 epochs the
student is still under-trained and distillation did not help it (docs/reducers-distill-sift.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench_runs import load_note, split_passthrough, train

from neuron_train.training.checkpoint import list_checkpoints


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    argv, extra = split_passthrough(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", default="vit-micro", help="teacher model (preset or timm name)")
    p.add_argument("--student", default="vit-digits", help="student model (preset or timm name)")
    p.add_argument("--epochs", type=int, default=20, help="epochs for every run")
    p.add_argument("--teacher-epochs", type=int, default=None, help="epochs for the teacher (default: --epochs)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="student seeds")
    p.add_argument("--alpha", type=float, default=0.5, help="--distill-alpha")
    p.add_argument("--temperature", type=float, default=4.0, help="--distill-temperature")
    p.add_argument("--teacher-checkpoint", default=None, help="skip training the teacher: use this file")
    p.add_argument("--out", type=Path, default=Path(f"runs/bench-distill-{time.strftime('%Y%m%d-%H%M%S')}"),
                   help="directory for all runs (must not exist)")
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"{args.out} exists: choose another --out (results are never overwritten)")
    return args, extra


def row(name: str, model: str, params: int, runs: list[dict], extra: str = "") -> str:
    accs = [r["eval_accuracy"] for r in runs]
    mean = statistics.mean(accs)
    spread = f" ± {statistics.stdev(accs):.3f}" if len(accs) > 1 else ""
    each = " ".join(f"{a:.3f}" for a in accs)
    step_ms = statistics.median(r["step_time_ms_median"] for r in runs)
    return (f"{name:<18} {model:<20} {params / 1e6:>7.3f} M  {step_ms:>7.1f} ms  {mean:.3f}{spread:<8}  "
            f"[{each}]{extra}")


def main(argv: list[str]) -> int:
    args, extra = parse_args(argv)
    print(f"start: {load_note()}", flush=True)
    common = ["--epochs", str(args.epochs), *extra]
    teacher_ckpt = args.teacher_checkpoint
    teacher_runs: list[dict] = []
    if teacher_ckpt is None:
        epochs = str(args.teacher_epochs or args.epochs)
        run = train(args.out / "teacher", ["--model", args.teacher, *common, "--epochs", epochs,
                                           "--seed", str(args.seeds[0])], "teacher")
        teacher_runs = [run.summary]
        teacher_ckpt = str(list_checkpoints(args.out / "teacher")[-1])
    alone, distilled, params = [], [], {}
    for seed in args.seeds:
        s = train(args.out / f"student-seed{seed}", ["--model", args.student, *common, "--seed", str(seed)],
                  f"student seed {seed}").summary
        alone.append(s)
        d = train(args.out / f"distilled-seed{seed}",
                  ["--model", args.student, *common, "--seed", str(seed), "--teacher-model", args.teacher,
                   "--teacher-checkpoint", teacher_ckpt, "--distill-alpha", str(args.alpha),
                   "--distill-temperature", str(args.temperature)], f"distilled seed {seed}").summary
        distilled.append(d)
        params = {"teacher": d["teacher_params"], "student": d["student_params"]}
    print(f"\nend: {load_note()}")
    print(f"\ndigits validation accuracy after {args.epochs} epochs, seeds {args.seeds}, "
          f"alpha {args.alpha}, T {args.temperature}")
    print(f"{'run':<18} {'model':<20} {'params':>9}  {'step':>10}  {'accuracy':<14}  [per seed]")
    if teacher_runs:
        print(row("teacher", args.teacher, params["teacher"], teacher_runs))
    else:
        print(f"{'teacher':<18} {args.teacher:<20} {params['teacher'] / 1e6:>7.3f} M  (from {teacher_ckpt})")
    print(row("student alone", args.student, params["student"], alone))
    gain = statistics.mean(d["eval_accuracy"] for d in distilled) - statistics.mean(
        s["eval_accuracy"] for s in alone)
    print(row("student distilled", args.student, params["student"], distilled,
              f"  {gain * 100:+.1f} points vs alone"))
    print(f"student/teacher parameters: {params['student'] / params['teacher']:.1%}; step: median "
          "step time (median over seeds), the distilled step includes the teacher's forward")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
