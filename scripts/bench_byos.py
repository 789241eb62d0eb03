"""`bench -- COMMAND` against a script's own printed rate, and what the instrumentation costs it.

Runs a script that prints its own training rate (aws-neuron-samples mnist_mlp/train.py prints
"Train throughput (iter/sec): X" over its last epoch's steps 2..end) alternately plain and under
`neuron-train bench --steps 0` (the whole script, instrumented), and reports the medians:

- agreement: bench's samples/s vs the script's own rate in the same instrumented run (the same
  steps timed two ways: from the syncs by bench, with time.time() by the script);
- overhead: the script's own rate plain vs instrumented (what the graph checker and the probe cost
  the steady step: PT_XLA_DEBUG per-execution analysis, the sync and copy wrappers).

    python scripts/bench_byos.py --script-dir tests/corpus/neuron_mnist_mlp --epochs 1 --runs 5

Writes nothing but a temporary folder. The machine's load shifts single runs: read the medians.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script-dir", type=Path, required=True, help="a folder with mnist_mlp's train.py")
    p.add_argument("--epochs", type=int, default=1, help="EPOCHS in the copy (1: bench and the script time "
                   "the same steps)")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-byos-") as tmp:
        work = Path(tmp) / "w"
        shutil.copytree(args.script_dir, work, ignore=shutil.ignore_patterns("__pycache__", "checkpoints"))
        train = work / "train.py"
        text, n = re.subn(r"^EPOCHS = \d+", f"EPOCHS = {args.epochs}", train.read_text(), flags=re.M)
        if n != 1:
            raise SystemExit("no EPOCHS constant in train.py")
        batch = int(re.search(r"^BATCH_SIZE = (\d+)", text, re.M).group(1))
        train.write_text(text)
        plain, instrumented, bench = [], [], []
        for i in range(args.runs):
            plain.append(own_rate(run([sys.executable, "train.py"], work), batch))
            result = Path(tmp) / f"r{i}.json"
            out = run([sys.executable, "-m", "neuron_train", "bench", "--steps", "0", "--output", str(result),
                       "--", sys.executable, "train.py"], work)
            instrumented.append(own_rate(out, batch))
            bench.append(json.loads(result.read_text())["samples_per_sec"]["median"])
            print(f"run {i + 1}: plain {plain[-1]:.0f}, instrumented {instrumented[-1]:.0f} (script's own), "
                  f"bench {bench[-1]:.0f} samples/s", flush=True)
    report(plain, instrumented, bench, batch)
    return 0


def report(plain: list[float], instrumented: list[float], bench: list[float], batch: int) -> None:
    agreement = [b / s - 1 for b, s in zip(bench, instrumented, strict=True)]
    m_plain, m_inst = statistics.median(plain), statistics.median(instrumented)
    print(f"agreement: bench vs the script's own rate, median {statistics.median(agreement):+.1%} "
          f"(runs: {', '.join(f'{a:+.1%}' for a in agreement)})")
    print(f"overhead:  the script's own rate {m_plain:.0f} samples/s plain, {m_inst:.0f} instrumented: "
          f"{m_plain / m_inst - 1:+.1%} per step ({1000 * batch / m_inst - 1000 * batch / m_plain:+.2f} ms)")


if __name__ == "__main__":
    sys.exit(main())
