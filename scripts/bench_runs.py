"""Shared by the benchmark scripts: launch one training run and time its evaluations.

Each run is `neuron_train/run.py` in its own process (a fresh XLA runtime, so its compile counters
and timings are its own). Evaluation lines are stamped with the wall time since launch as they
arrive, which gives "time to reach an accuracy" including start-up and compilation.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_PY = ROOT / "neuron_train" / "run.py"
_EVAL_LINE = re.compile(r"step (\d+): eval accuracy ([0-9.]+)")


@dataclass
class Eval:
    step: int
    accuracy: float
    wall_s: float   # since the process was launched


@dataclass
class Run:
    summary: dict
    evals: list[Eval]

    def first_reaching(self, target: float) -> Eval | None:
        return next((e for e in self.evals if e.accuracy >= target), None)


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """The script's own arguments, and those after `--` that go to every training run."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def train(out: Path, args: list[str], label: str, nproc: int = 1) -> Run:
    """Train into run directory `out` (must not hold a run); stop the benchmark if the run fails.

    `nproc` > 1 launches that many data-parallel processes under torchrun."""
    launcher = [sys.executable, str(RUN_PY)]
    if nproc > 1:
        launcher[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*launcher, "--output-dir", str(out), "--no-progress", "--no-tensorboard", *args]
    print(f"[{label}] {' '.join(cmd[1:])}", flush=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    # One pipe for both streams: reading only stdout could block on a full stderr pipe.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    evals, last = [], "no output"
    for line in proc.stdout:
        last = line.strip() or last
        match = _EVAL_LINE.search(line)
        if match:
            evals.append(Eval(int(match[1]), float(match[2]), time.perf_counter() - start))
            print(f"[{label}] {line.strip()}", flush=True)
    if proc.wait() != 0:
        sys.exit(f"{label} run failed (exit {proc.returncode}): {last}")
    return Run(json.loads((out / "summary.json").read_text()), evals)


def load_note() -> str:
    """The machine's load: figures measured on a busy host are slower than they should be."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"
