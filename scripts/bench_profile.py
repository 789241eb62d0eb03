"""Step-phase profiles of runs with different bottlenecks, side by side (`--profile`).

    python scripts/bench_profile.py [--steps 30] [--out DIR] [--only NAME ...]

Scenarios:
  digits          vit-digits on the digits data, defaults (2 loader workers)
  slow-input      vit-digits on an image folder of large JPEGs (decode + resize per sample), no
                  loader workers: the input pipeline runs in the loader thread of the main process
  slow-input-w2   the same with --num-workers 2
  big-model       vit-micro at 96 px, batch 64, synthetic data: more device work per traced op
  accum2          digits with --grad-accum 2 --batch-size 16: two graph cuts per step
  bpe2            the same with --batches-per-execution 2: one graph cut per step

Prints each run's profile table (the one `--profile` prints at the end of a run), then one line per
scenario. The image folder for slow-input is generated under --out (about 60 MB).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench_runs import load_note, train

from neuron_train.training.profiler import format_table


def make_slow_images(root: Path, classes: int = 8, per_class: int = 20, size=(1024, 768)) -> Path:
    """Noise JPEGs: they decode slowly and compress badly, like large photos."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        d = root / "train" / f"class{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(d / f"{i}.jpg", quality=90)
    return root


def scenarios(out: Path, steps: int) -> dict[str, list[str]]:
    base = ["--max-steps", str(steps), "--eval-every", "100000", "--profile"]
    images = out / "images"
    slow = ["--model", "vit-digits", "--dataset", "folder", "--data-dir", str(images), "--img-size", "32"]
    return {
        "digits": ["--model", "vit-digits", *base],
        "slow-input": [*slow, "--num-workers", "0", *base],
        "slow-input-w2": [*slow, "--num-workers", "2", *base],
        "big-model": ["--model", "vit-micro", "--img-size", "96", "--batch-size", "64",
                      "--dataset", "synthetic", *base],
        "accum2": ["--model", "vit-digits", "--grad-accum", "2", "--batch-size", "16", *base],
        "bpe2": ["--model", "vit-digits", "--grad-accum", "2", "--batch-size", "16",
                 "--batches-per-execution", "2", *base],
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--only", nargs="+", default=None, help="run only these scenarios")
    p.add_argument("--out", type=Path, default=Path(f"runs/bench-profile-{time.strftime('%Y%m%d-%H%M%S')}"),
                   help="directory for all runs (must not exist)")
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"{args.out} exists: choose another --out (results are never overwritten)")
    todo = scenarios(args.out, args.steps)
    unknown = set(args.only or []) - set(todo)
    if unknown:
        p.error(f"unknown scenario(s) {sorted(unknown)}; known: {', '.join(todo)}")
    todo = {k: v for k, v in todo.items() if not args.only or k in args.only}
    print(f"# step-phase profiles, {args.steps} steps each; {load_note()}", flush=True)
    if any("--data-dir" in v for v in todo.values()):
        make_slow_images(args.out / "images")

    results = {}
    for name, flags in todo.items():
        run_dir = args.out / name
        train(run_dir, flags, name)
        results[name] = json.loads((run_dir / "profile.json").read_text())["summary"]
        print(f"\n## {name}: {' '.join(flags)}\n{format_table(results[name])}\n", flush=True)

    print(f"{'scenario':<14} {'bottleneck':<14} {'steady state':<14} {'step ms':>8} {'input':>7} "
          f"{'host':>7} {'dev exec':>9} {'dev wait':>9}")
    for name, s in results.items():
        f = s["figures_ms_per_step"]
        print(f"{name:<14} {s['bottleneck']:<14} {s['steady_bottleneck']:<14} {f['wall']:>8.1f} "
              f"{f['input_wait']:>7.1f} {f['host']:>7.1f} {f['execute']:>9.1f} "
              f"{f['device_wait'] + f['grad_sync']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
