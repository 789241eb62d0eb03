"""What does timm's recipe cost and buy on XLA? Accuracy with and without it, step time, host cost.

    python scripts/bench_recipe.py [--parts host,device,cost,accuracy] [--seeds 0 1 2] [--out DIR]

Four parts, each printing its figures (docs/measurements.md, "timm's recipe", holds a run's):
- accuracy: the README's first workload (digits, vit-digits, 2 processes, --digits-epochs 16) and a
  harder generated one ("noisy digits": the same digits, each drawn once at a random offset and
  scale, light ink of random colours on darker random backgrounds, with pixel noise, as a 32 px
  PNG image folder under --out; a logistic regression reaches 0.68 on it, 0.92 on digits; one
  process, --noisy-epochs 8 = the first workload's 368 steps), each plain and with the recipe, same
  epochs, for every seed (runs interleaved: plain, recipe, plain, ...).
  Final validation accuracy, mean ± standard deviation over the seeds; EMA weights too for the recipe.
- cost: `--cost-pairs` rounds of short runs of our loop (plain; "device": the recipe's flags that
  change the device's work, --mixup/--cutmix/--smoothing/--model-ema; the full recipe), one
  process, digits, `--profile`, interleaved so that load from other work hits all alike. From each
  run's profile.json (steady steps): the step's wall time and its time excluding the loader wait
  (tracing, dispatch, execution); the ratios use the medians over the rounds. Graphs compiled in
  each run (summary.json's compile_count).
- device: the device's added work alone, in this one process: the lazy step (Neuron's default path)
  of vit-digits on hard labels, and on soft targets with the EMA update traced into it, timed in
  interleaved rounds of 10 steps (wall time to the last step's completion); load from other work
  hits both alike within a round. The ratio per round, its median and range.
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
    p.add_argument("--parts", default="host,device,cost,accuracy",
                   help="comma-separated: host, device, cost, accuracy")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the accuracy runs")
    p.add_argument("--digits-epochs", type=int, default=16, help="epochs on digits (the README's 16)")
    p.add_argument("--noisy-epochs", type=int, default=8, help="epochs on the generated noisy digits")
    p.add_argument("--cost-pairs", type=int, default=2, help="plain/recipe run pairs for the step time")
    p.add_argument("--cost-steps", type=int, default=40, help="steps of each cost run")
    p.add_argument("--device-rounds", type=int, default=15, help="interleaved rounds of the device part")
    p.add_argument("--host-samples", type=int, default=2048, help="samples timed in the host part")
    p.add_argument("--out", type=Path, default=Path(f"runs/bench-recipe-{time.strftime('%Y%m%d-%H%M%S')}"),
                   help="directory for all runs (must not exist)")
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"{args.out} exists: choose another --out (results are never overwritten)")
    unknown = set(args.parts.split(",")) - {"accuracy", "cost", "device", "host"}
    if unknown:
        p.error(f"--parts: unknown part(s) {', '.join(sorted(unknown))}")
    return args


# ----- the generated dataset -------------------------------------------------------------------

def noisy_digit(pixels, rng):
    """One of scikit-learn's 8x8 digits (values 0..16) drawn at 32 px at a random offset (±3 px) and
    scale (22 to 28 px), light ink of a random colour on a darker random background, with Gaussian
    pixel noise (σ 20)."""
    import numpy as np
    from PIL import Image

    bg = rng.integers(0, 100, 3)
    fg = bg + rng.integers(100, 156, 3)  # lighter than the background in every channel: digits' polarity
    side = int(rng.integers(22, 29))
    ink = np.asarray(Image.fromarray((pixels * 255 / 16).astype(np.uint8)).resize((side, side), Image.BILINEAR),
                     dtype=np.float32)[..., None] / 255
    canvas = np.zeros((32, 32, 1), np.float32)
    lo, hi = max(0, 16 - side // 2 - 3), min(32 - side, 16 - side // 2 + 3)
    x, y = (int(v) for v in rng.integers(lo, hi + 1, 2))
    canvas[y:y + side, x:x + side] = ink
    img = canvas * fg + (1 - canvas) * bg + rng.normal(0, 20, (32, 32, 3))
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
        "digits": (args.digits_epochs, [], 2),  # the README's first command
        # one process (global batch 32): --noisy-epochs 8 is the first workload's 368 steps
        "noisy-digits": (args.noisy_epochs, ["--dataset", "folder", "--data-dir", str(noisy), "--num-workers", "0"], 1),
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
        print(f"\n{name}: final validation accuracy, {epochs} epochs, {nproc} processes, "
              f"seeds {args.seeds} (mean ± sd [each])")
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


def device(args: argparse.Namespace) -> None:
    """In this one process, interleaved: the lazy step (the Neuron default) of vit-digits on hard
    labels vs on soft targets with the EMA update traced into it; the device's extra work alone."""
    import torch
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.core.xla_model as xm
    from timm.utils import ModelEmaV3

    from neuron_train.training.ema import ModelEma
    from neuron_train.training.models import create_model

    dev, batch = torch_xla.device(), 32
    x = torch.randn(batch, 3, 32, 32).to(dev)
    hard = (torch.arange(batch) % 10).to(dev)
    soft = F.one_hot(torch.arange(batch) % 10, 10).float().mul(0.9).add(0.01).to(dev)

    def variant(recipe: bool):
        torch.manual_seed(0)
        host = create_model("vit-digits", num_classes=10, img_size=32)
        ema = ModelEmaV3(host, decay=0.99, stochastic_rounding=False) if recipe else None
        model = host.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        update = None
        if ema is not None:
            ema.module.to(dev)
            update = ModelEma(ema, model).update

        def steps(n: int) -> tuple[float, float]:
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(n):
                F.cross_entropy(model(x), soft if recipe else hard).backward()
                opt.step()
                opt.zero_grad()
                if update is not None:
                    update()
                torch_xla.sync()  # the step's end, as the loop's
            xm.wait_device_ops()  # timing: every step executed
            return (time.perf_counter() - start) / n * 1e3, (time.process_time() - cpu) / n * 1e3
        return steps

    plain, recipe = variant(False), variant(True)
    plain(3), recipe(3)  # compile both
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "recipe": []}
    for _ in range(args.device_rounds):
        times["plain"].append(plain(10))
        times["recipe"].append(recipe(10))
    print(f"\ndevice: lazy step, vit-digits, batch 32, in one process, {args.device_rounds} interleaved rounds "
          "of 10 steps each (ms per step; the device's added work: soft-target loss + EMA update)")
    for i, clock in enumerate(("wall time", "CPU time of this process (host + the CPU device's threads)")):
        print(f"  {clock}:")
        for kind, ts in times.items():
            print(f"    {kind:<8} median {statistics.median(t[i] for t in ts):.1f}  "
                  f"[{' '.join(f'{t[i]:.1f}' for t in ts)}]")
        ratios = [r[i] / p[i] for p, r in zip(times["plain"], times["recipe"], strict=True)]
        print(f"    recipe / plain per round: median {statistics.median(ratios):.3f}, "
              f"range {min(ratios):.3f}-{max(ratios):.3f} (target <= 1.05)", flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True)
    parts = args.parts.split(",")
    print(f"start {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {load_note()}", flush=True)
    for name, part in (("host", host), ("device", device), ("cost", cost), ("accuracy", accuracy)):
        if name in parts:
            part(args)
            print(f"after {name}: {load_note()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
