"""`bench -- COMMAND` against a script's own printed rate, and what the probe costs a step.

1. Agreement: aws-neuron-samples' mnist_mlp/train.py (one epoch; it prints "Train throughput
   (iter/sec): X" over its steps 2..39) runs under `neuron-train bench --steps 0`; bench's samples/s
   is compared with the script's own rate from the same run (the same steps, timed from the syncs
   by bench and with time.time() by the script, which counts 37 steps for 38 timed: 2.7% low).
2. Overhead: in this process, the same script's model and optimizer step (batch 32, MLP 784-120-84-10)
   runs in alternating blocks with torch_xla's own sync and Tensor.to, and with the probe's wrappers
   (`instrument.probe.arm` in bench mode, as `bench -- COMMAND` installs them). Alternating blocks cancel
   the machine's load drift; the median block difference is the probe's cost per step.

    python scripts/bench_byos.py --script-dir tests/corpus/neuron_mnist_mlp --runs 5

Writes nothing but a temporary folder.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RATE = re.compile(r"Train throughput \(iter/sec\): ([\d.]+)")


def own_rate(output: str, batch: int) -> float:
    found = RATE.findall(output)
    if not found:
        raise SystemExit(f"the script printed no rate:\n{output[-2000:]}")
    return float(found[-1]) * batch


def run(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc.stdout + proc.stderr


def copy_script(src: Path, dest: Path, epochs: int) -> int:
    """A copy of the mnist_mlp folder with EPOCHS set; returns BATCH_SIZE."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "checkpoints", "planted_*"))
    train = dest / "train.py"
    text, n = re.subn(r"^EPOCHS = \d+", f"EPOCHS = {epochs}", train.read_text(), flags=re.M)
    if n != 1:
        raise SystemExit("no EPOCHS constant in train.py")
    train.write_text(text)
    return int(re.search(r"^BATCH_SIZE = (\d+)", text, re.M).group(1))


def agreement(script_dir: Path, runs: int, tmp: Path) -> list[float]:
    work = tmp / "e1"
    batch = copy_script(script_dir, work, 1)
    out_of = []
    for i in range(runs):
        result = tmp / f"r{i}.json"
        out = run([sys.executable, "-m", "neuron_train", "bench", "--steps", "0", "--output", str(result), "--",
                      sys.executable, "train.py"], work)
        sps, own = json.loads(result.read_text())["samples_per_sec"]["median"], own_rate(out, batch)
        out_of.append(sps / own - 1)
        print(f"run {i + 1}: bench {sps:.0f} vs the script's own {own:.0f} samples/s ({out_of[-1]:+.1%})", flush=True)
    return out_of


def overhead(script_dir: Path, blocks: int, steps: int) -> tuple[float, float]:
    """Median ms per step with torch_xla's own functions and with the probe's wrappers."""
    from neuron_train.graphs.process import ENV_DIR
    from neuron_train.instrument import probe as script_probe

    records = tempfile.mkdtemp(prefix="bench-byos-probe-")  # the probe writes its record at exit ...
    atexit.register(shutil.rmtree, records, True)            # ... and this runs after it (atexit: LIFO)
    os.environ.update({ENV_DIR: records, script_probe.MODE_ENV: "bench", script_probe.STEPS_ENV: "0"})
    sys.path.insert(0, str(script_dir))
    import torch
    import torch_xla
    from model import MLP  # the script's own model

    module, xlac = sys.modules["torch_xla.torch_xla"], torch_xla._XLAC
    plain = (torch_xla.sync, torch.Tensor.to, xlac._xla_tensors_from_aten)
    script_probe.arm(None)  # bench mode: wraps sync, Tensor.to and the bulk copy
    probed = (torch_xla.sync, torch.Tensor.to, xlac._xla_tensors_from_aten)

    def use(fns) -> None:
        torch_xla.sync = module.sync = fns[0]
        torch.Tensor.to, xlac._xla_tensors_from_aten = fns[1], fns[2]

    dev = torch_xla.device()
    model = MLP().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.rand(32, 784), torch.randint(0, 10, (32,))

    def block() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.nll_loss(model(x.to(dev)), y.to(dev))
            loss.backward()
            opt.step()
            torch_xla.sync()  # the step's graph runs here, as in the script (mark_step)
        torch_xla.sync(wait=True)  # the last step has run when the block's clock stops
        return (time.perf_counter() - start) / steps * 1e3

    times: dict[str, list[float]] = {"plain": [], "probed": []}
    for fns in (plain, probed):  # warm-up: compile the step graphs once
        use(fns)
        block()
    for _ in range(blocks):
        for label, fns in (("plain", plain), ("probed", probed)):
            use(fns)
            times[label].append(block())
    use(plain)
    return statistics.median(times["plain"]), statistics.median(times["probed"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script-dir", type=Path, required=True, help="a folder with mnist_mlp's train.py")
    p.add_argument("--runs", type=int, default=5, help="bench runs for the agreement")
    p.add_argument("--blocks", type=int, default=20, help="alternating blocks for the overhead")
    p.add_argument("--block-steps", type=int, default=50)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-byos-") as tmp:
        found = agreement(args.script_dir, args.runs, Path(tmp))
    plain, probed = overhead(args.script_dir, args.blocks, args.block_steps)
    print(f"agreement: bench vs the script's own rate, median {statistics.median(found):+.1%} "
          f"(runs: {', '.join(f'{a:+.1%}' for a in found)})")
    print(f"overhead:  {plain:.3f} ms per step plain, {probed:.3f} ms with the probe "
          f"({(probed - plain) * 1e3:+.0f} us, {probed / plain - 1:+.1%}; medians of {args.blocks} alternating "
          f"blocks of {args.block_steps} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
