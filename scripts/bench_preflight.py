"""What the checks before start-up cost and save (the figures in docs/reliability.md, "Training runs").

1. The up-front image check of a folder dataset: N JPEGs of 500x375 (about ImageNet's mean size),
   timed through `check_images` (header, end marker) with a warm page cache.
2. How long a refused run takes: `run.py --model nosuch` (refused before torch_xla starts).

    python scripts/bench_preflight.py [--images 3000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neuron_train.training.config import DataConfig  # noqa: E402
from neuron_train.training.data import build_datasets, check_images  # noqa: E402


def image_check(n: int, tmp: Path) -> str:
    from PIL import Image

    classes = 10
    for c in range(classes):
        d = tmp / "imgs" / "train" / f"c{c}"
        d.mkdir(parents=True)
        img = Image.effect_noise((500, 375), 40).convert("RGB")
        for i in range(n // classes):
            img.save(d / f"{i}.jpg", quality=90)
    root = tmp / "imgs"
    data = build_datasets(DataConfig(dataset="folder", data_dir=str(root)), 32, 0, 0)
    files = [p for p, _ in data.train.samples]
    kib = sum(os.path.getsize(p) for p in files) / len(files) / 1024
    start = time.perf_counter()
    check_images(data, root)
    took = time.perf_counter() - start
    return (f"image check: {len(files)} JPEGs 500x375 ({kib:.0f} KiB each): {took:.2f} s = "
            f"{took / len(files) * 1e3:.2f} ms a file")


def refused_run(tmp: Path) -> str:
    out = tmp / "run"
    cmd = [sys.executable, str(ROOT / "neuron_train" / "run.py"), "--output-dir", str(out), "--model", "nosuch",
           "--max-steps", "2", "--no-progress", "--no-tensorboard", "--num-workers", "0"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PJRT_DEVICE": "CPU"})
    took = time.perf_counter() - start
    return (f"refused run (--model nosuch): exit {proc.returncode} after {took:.1f} s, run dir "
            f"{'left behind' if out.exists() else 'not created'}: {proc.stderr.strip().splitlines()[-1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(image_check(args.images, Path(tmp)))
        print(refused_run(Path(tmp)))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
