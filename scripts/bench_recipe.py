"""What does timm's recipe cost and buy on XLA? Accuracy with and without it, step time, host cost.

    python scripts/bench_recipe.py [--parts accuracy,cost,host] [--seeds 0 1 2] [--out DIR]

Three parts, each printing its figures (docs/measurements.md, "timm's recipe", holds a run's):
- accuracy: the README's first workload (digits, vit-digits, 2 processes, --digits-epochs 16) and a
  harder generated one ("noisy digits": the same digits, each drawn once at a random offset and
  scale, in random colours, with pixel noise, as a 32 px PNG image folder under --out), each
  plain and with the recipe, same epochs, for every seed (runs interleaved: plain, recipe, plain, ...).
  Final validation accuracy, mean ± standard deviation over the seeds; EMA weights too for the recipe.
- cost: `--cost-pairs` pairs of short runs (plain, recipe, plain, recipe, ...; one process, digits,
  `--profile`), interleaved so that load from other work hits both alike. From each run's
  profile.json (steady steps): the step's wall time, its time excluding the loader wait (the
  device side: tracing, dispatch, execution), and XLA's ExecuteTime; the ratios recipe / plain use
  the medians over the pairs. Graphs compiled in each run (summary.json's compile_count).
- host: the augmentation's host cost per sample for one loader worker: timm's per-sample stages
  (RandAugment, random erasing) on the digits training set, then our collate (timm's Mixup/CutMix
  and soft targets) on batches of them, timed in this one process (no XLA).

The recipe is timm's ViT recipe (`RECIPE`), with --model-ema-decay 0.99 instead of timm's 0.9998:
these runs are a few hundred steps, and an EMA with a 5,000-step time constant would still be
mostly the initial weights. Each run is a fresh process (bench_runs.train); run it alone on the
machine (nice -n 10 if shared): figures under load are slower, ratios noisier.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench_runs import load_note, train

RECIPE = ["--aa", "rand-m9-mstd0.5-inc1", "--reprob", "0.25", "--mixup", "0.8", "--cutmix", "1.0",
          "--smoothing", "0.1", "--model-ema", "--model-ema-decay", "0.99"]
DEVICE_PART = RECIPE[4:]  # --mixup ... --model-ema-decay: everything that changes the device's work


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="accuracy,cost,host", help="comma-separated: accuracy, cost, host")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the accuracy runs")
    p.add_argument("--digits-epochs", type=int, default=16, help="epochs on digits (the README's 16)")
    p.add_argument("--noisy-epochs", type=int, default=16, help="epochs on the generated noisy digits")
    p.add_argument("--cost-pairs", type=int, default=3, help="plain/recipe run pairs for the step time")
    p.add_argument("--cost-steps", type=int, default=60, help="steps of each cost run")
    p.add_argument("--host-samples", type=int, default=2048, help="samples timed in the host part")
    p.add_argument("--out", type=Path, default=Path(f"runs/bench-recipe-{time.strftime('%Y%m%d-%H%M%S')}"),
                   help="directory for all runs (must not exist)")
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"{args.out} exists: choose another --out (results are never overwritten)")
    unknown = set(args.parts.split(",")) - {"accuracy", "cost", "host"}
    if unknown:
        p.error(f"--parts: unknown part(s) {', '.join(sorted(unknown))}")
    return args


# ----- the generated dataset -------------------------------------------------------------------

def noisy_digit(pixels, rng):
    """One of scikit-learn's 8x8 digits (values 0..16) drawn at 32 px at a random offset (±4 px) and
    scale (20 to 28 px), in a random colour on a random background, with Gaussian pixel noise (σ 24)."""
    import numpy as np
    from PIL import Image

    bg = rng.integers(0, 256, 3)
    fg = bg
    while np.abs(fg - bg).sum() < 200:  # visible, but not always light on dark
        fg = rng.integers(0, 256, 3)
    side = int(rng.integers(20, 29))
    ink = np.asarray(Image.fromarray((pixels * 255 / 16).astype(np.uint8)).resize((side, side), Image.BILINEAR),
                     dtype=np.float32)[..., None] / 255
    canvas = np.zeros((32, 32, 1), np.float32)
    x, y = (int(v) for v in rng.integers(max(0, 16 - side // 2 - 4), min(32 - side, 16 - side // 2 + 4) + 1, 2))
    canvas[y:y + side, x:x + side] = ink
    img = canvas * fg + (1 - canvas) * bg + rng.normal(0, 24, (32, 32, 3))
    return Image.fromarray(img.clip(0, 255).astype(np.uint8))


def make_noisy_digits(root: Path, seed: int = 0) -> Path:
    """An image folder (train/, val/) of the 1,797 digits, each drawn once by `noisy_digit`: the
    first workload's images made harder (position, scale, colour, noise), the same 300 for val."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(1234)).tolist()
    rng = np.random.default_rng(seed)
    for n, i in enumerate(order):
        folder = root / ("val" if n < 300 else "train") / str(digits.target[i])  # data.py's split
        folder.mkdir(parents=True, exist_ok=True)
        noisy_digit(digits.images[i], rng).save(folder / f"{i}.png")
    return root


# ----- accuracy ----------------------------------------------------------------------------------

def _mean_sd(values: list[float]) -> str:
    sd = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.3f}{sd} [{' '.join(f'{v:.3f}' for v in values)}]"


def accuracy(args: argparse.Namespace) -> None:
    noisy = make_noisy_digits(args.out / "noisy-digits-data")
    workloads = {  # name: (epochs, other train flags, processes)
        "noisy-digits": (args.noisy_epochs, ["--dataset", "folder", "--data-dir", str(noisy), "--num-workers", "1"], 2),
        "digits": (args.digits_epochs, [], 2),  # the README's first command
    }
    for name, (epochs, other, nproc) in workloads.items():
        flags = ["--epochs", str(epochs), *other]
        runs: dict[str, list[dict]] = {"plain": [], "recipe": []}
        for seed in args.seeds:
            for kind, extra in (("plain", []), ("recipe", RECIPE)):
                out = args.out / f"{name}-{kind}-seed{seed}"
                runs[kind].append(train(out, [*flags, "--seed", str(seed), *extra], f"{name} {kind} {seed}",
                                        nproc=nproc).summary)
        plain, recipe = runs["plain"], runs["recipe"]
        print(f"\n{name}: final validation accuracy, {epochs} epochs, {nproc} processes, seeds {args.seeds} (mean ± sd [each])")
        print(f"  plain          {_mean_sd([r['eval_accuracy'] for r in plain])}")
        print(f"  recipe (raw)   {_mean_sd([r['eval_accuracy'] for r in recipe])}")
        print(f"  recipe (EMA)   {_mean_sd([r['eval_ema_accuracy'] for r in recipe])}")
        print(f"  graphs compiled: plain {sorted({r['compile_count'] for r in plain})}, "
              f"recipe {sorted({r['compile_count'] for r in recipe})}; step ms (median of runs): "
              f"plain {statistics.median(r['step_time_ms_median'] for r in plain):.1f}, "
              f"recipe {statistics.median(r['step_time_ms_median'] for r in recipe):.1f}", flush=True)


# ----- cost ------------------------------------------------------------------------------------------

def _profile(out: Path) -> dict:
    import json

    s = json.loads((out / "profile.json").read_text())["summary"]
    f = s["figures_ms_per_step"]
    return {"wall": f["wall"], "no_wait": f["wall"] - f["input_wait"], "input_wait": f["input_wait"]}


def cost(args: argparse.Namespace) -> None:
    flags = ["--max-steps", str(args.cost_steps), "--eval-every", "0", "--profile", "--seed", "0"]
    kinds = {"plain": [], "device": DEVICE_PART, "recipe": RECIPE}
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for i in range(args.cost_pairs):
        for kind, extra in kinds.items():
            out = args.out / f"cost-{kind}-{i}"
            summary = train(out, [*flags, *extra], f"cost {kind} {i}").summary
            runs[kind].append({**_profile(out), "graphs": summary["compile_count"]})
    print(f"\ncost: digits, vit-digits, batch 32, 1 process, {args.cost_steps} steps, {args.cost_pairs} "
          "interleaved rounds; ms per steady step (mean over a run's steady steps; median over runs)")
    print(f"  {'':<8}{'wall':>9}{'no loader wait':>16}{'loader wait':>13}  graphs  [no loader wait, each run]")
    med = {}
    for kind, rs in runs.items():
        med[kind] = {k: statistics.median(r[k] for r in rs) for k in ("wall", "no_wait", "input_wait")}
        m, each = med[kind], " ".join(f"{r['no_wait']:.1f}" for r in rs)
        print(f"  {kind:<8}{m['wall']:>9.1f}{m['no_wait']:>16.1f}{m['input_wait']:>13.1f}  "
              f"{[r['graphs'] for r in rs]}  [{each}]")
    p = med["plain"]
    for kind in ("device", "recipe"):
        r = med[kind]
        print(f"  {kind} / plain: wall {r['wall'] / p['wall']:.3f}, step minus loader wait "
              f"{r['no_wait'] / p['no_wait']:.3f}")
    print("  (device: what the device sees of the recipe, soft targets + the EMA, without the per-sample "
          "host stages that compete with the step for the host's cores; target <= 1.05)", flush=True)


# ----- host cost of the augmentation ---------------------------------------------------------------

def host(args: argparse.Namespace) -> None:
    import torch

    from neuron_train.training.augment import recipe_training_set
    from neuron_train.training.config import RunConfig
    from neuron_train.training.config_io import config_from_train_args
    from neuron_train.training.data import build_datasets

    torch.set_num_threads(1)  # one loader worker's share: a worker process computes on one thread
    cfg: RunConfig = config_from_train_args(RECIPE, prog="bench_recipe")
    data = build_datasets(cfg.data, cfg.model.img_size, 0, seed=0)
    plain = data.train
    train_set, collate = recipe_training_set(cfg, data)
    assert collate is not None
    n, batch = args.host_samples, cfg.train.batch_size
    idx = [i % len(plain) for i in range(n)]
    timings = {}
    for name, ds in (("plain sample (a tensor slice)", plain), ("RandAugment + random erasing", train_set)):
        t0 = time.perf_counter()
        items = [ds[i] for i in idx]
        timings[name] = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for b in range(0, n - batch + 1, batch):
        collate(items[b:b + batch])
    timings["Mixup/CutMix + soft targets (collate)"] = (time.perf_counter() - t0) / (n // batch * batch)
    print(f"\nhost: the augmentation's cost per sample, one loader worker (one process, one torch thread), "
          f"digits at {cfg.model.img_size} px, {n} samples, batches of {batch}")
    for name, s in timings.items():
        print(f"  {name:<40}{s * 1e3:>8.3f} ms/sample")
    aug = sum(v for k, v in timings.items() if not k.startswith("plain"))
    print(f"  recipe total {aug * 1e3:.3f} ms/sample: {batch} samples = {aug * batch * 1e3:.1f} ms per batch "
          "per worker", flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True)
    parts = args.parts.split(",")
    print(f"start {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {load_note()}", flush=True)
    for name, part in (("host", host), ("accuracy", accuracy), ("cost", cost)):
        if name in parts:
            part(args)
            print(f"after {name}: {load_note()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
