#!/usr/bin/env python3
"""How much does the graph checker slow a graph-stable run? Times the same training run three ways.

    python scripts/graphs_overhead.py [--repeats 3] [--model vit-digits] [--steps 60]

- plain:       python neuron_train/run.py ...                (GraphWatch in its cheap mode: compiles only)
- in-process:  python neuron_train/run.py ... --check-graphs (every execution logged, hooks, HLO dump)
- check-graphs: neuron-train check-graphs -- python neuron_train/run.py ...

The runs alternate (plain, in-process, check-graphs, plain, ...) so that load from other processes
hits all three alike. Prints, per mode, the steady-state step time (the loop's own median, after
its warm-up steps) and the wall time of the whole command: the best run (the least disturbed by
other load on a shared machine) and the median run, each with its ratio to plain.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_PY = ROOT / "neuron_train" / "run.py"


def run_args(args: argparse.Namespace, out: Path) -> list[str]:
    return [str(RUN_PY), "--model", args.model, "--dataset", "synthetic", "--synthetic-size",
            str(args.steps * args.batch_size), "--batch-size", str(args.batch_size), "--epochs", "1",
            "--log-every", "1", "--no-progress", "--no-tensorboard", "--num-workers", "0",
            "--output-dir", str(out)]


def modes(args: argparse.Namespace, out: Path) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "plain": [py, *run_args(args, out)],
        "in-process": [py, *run_args(args, out), "--check-graphs"],
        "check-graphs": [py, "-m", "neuron_train", "check-graphs", "--", py, *run_args(args, out)],
    }


def wall_time(command: list[str], cwd: Path = ROOT) -> float:
    """Seconds one run of `command` takes (on the CPU XLA device unless PJRT_DEVICE says otherwise)."""
    return timed(command, cwd)[0]


def timed(command: list[str], cwd: Path = ROOT, extra_env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `command` and every process it waited for. CPU time is
    what the run itself spent: other load on the machine stretches the wall time, hardly the CPU time."""
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"), PYTHONPATH=str(ROOT), **(extra_env or {}))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=cwd)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(command)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def time_once(command: list[str], out: Path) -> tuple[float, float]:
    """(wall seconds, median step ms) of one run."""
    wall = wall_time(command)
    summary = json.loads((out / "summary.json").read_text())
    return wall, summary["step_time_ms_median"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="vit-digits")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="graphs-overhead-") as tmp:
        for r in range(args.repeats):
            for name in ("plain", "in-process", "check-graphs"):
                out = Path(tmp) / f"{name}-{r}"
                results.setdefault(name, []).append(time_once(modes(args, out)[name], out))
                wall, step = results[name][-1]
                print(f"  run {r + 1}/{args.repeats} {name:12} wall {wall:6.1f} s  step {step:6.1f} ms",
                      flush=True)
    print(f"\n{args.model}, batch {args.batch_size}, {args.steps} steps, {args.repeats} runs per mode "
          f"(medians), {os.cpu_count()} CPUs, PJRT_DEVICE={os.environ.get('PJRT_DEVICE', 'CPU')}")
    print(f"{'mode':14}{'best step ms':>13}{'ratio':>7}{'median':>8}{'ratio':>7}"
          f"{'best wall s':>12}{'ratio':>7}{'median':>8}{'ratio':>7}")
    base = {stat: stat([s for _, s in results["plain"]]) for stat in (min, statistics.median)}
    base_wall = {stat: stat([w for w, _ in results["plain"]]) for stat in (min, statistics.median)}
    for name, runs in results.items():
        cells = []
        for values, ref in (([s for _, s in runs], base), ([w for w, _ in runs], base_wall)):
            for stat in (min, statistics.median):
                cells.append(f"{stat(values):{12 if stat is min else 8}.1f}{stat(values) / ref[stat]:7.2f}")
        print(f"{name:14}" + "".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
