#!/usr/bin/env python3
"""What `neuron-train check-graphs` costs on third-party scripts: wall time with and without it.

    python scripts/graphs_overhead_corpus.py [--repeats 3] [--only NAME ...]

Times graph-stable scripts: of the corpus (tests/corpus/SOURCES.md; skipped when not built)
aws-neuron-samples' mnist_mlp train.py (a plain mark_step loop, 160 steps), pytorch/xla's
test_train_mp_mnist.py (MpDeviceLoader, xm.optimizer_step, an eval loop and mesh_reduce, 2 epochs)
and test_train_mp_mnist_zero1.py (the same with ZeroRedundancyOptimizer, fake data, one epoch of
117 steps at batch 512: issue 20 measured 1.45x on it), and, always there, our fixture
tests/fixtures/instrument/epoch_eval.py (2 epochs of 12 steps and an evaluation) and
tests/fixtures/graphs/clean.py (8 steps: start-up alone, nearly), and our registry-library fixtures
tests/fixtures/scripts/hf_trainer.py (a Trainer run, 2 epochs with evaluation, both of its fixes
applied: graph-stable) and accelerate_loop.py (2 epochs of an accelerate loop). Each runs as
`python SCRIPT` and as `neuron-train check-graphs -- python SCRIPT`, alternating so that load from
other processes hits both alike. Prints the median wall time per mode and its ratio, and the median CPU
time (the run and every process it waited for) and its ratio: other load on the machine stretches the
wall time, hardly the CPU time, so the CPU ratio is the figure to trust on a busy machine.

On the CPU device the checker compiles with XLA's classic CPU kernel emitters (graphs/process.py,
`dump_flags`), which compile faster than the default ones: a third mode, the plain run with the same
emitters (`XLA_FLAGS=--xla_cpu_use_fusion_emitters=false`), gives the checker's own cost apart from
that ("own" ratios: checked against it). The first ratios are what a user sees.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from graphs_overhead import timed  # scripts/ is on sys.path when this file runs

from neuron_train.graphs.process import CPU_EMITTERS

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "corpus"
SCRIPTS = {
    "mnist_mlp/train.py": [str(CORPUS / "neuron_mnist_mlp" / "train.py")],
    "test_train_mp_mnist.py": [str(CORPUS / "pytorch_xla" / "test_train_mp_mnist.py"), "--fake_data",
                               "--num_epochs", "2", "--batch_size", "32", "--target_accuracy", "0",
                               "--log_steps", "5"],
    "test_train_mp_mnist_zero1.py": [str(CORPUS / "pytorch_xla" / "test_train_mp_mnist_zero1.py"), "--fake_data",
                                     "--num_epochs", "1", "--batch_size", "512", "--target_accuracy", "0",
                                     "--num_workers", "0"],
    "epoch_eval.py": [str(ROOT / "tests" / "fixtures" / "instrument" / "epoch_eval.py")],
    "clean.py": [str(ROOT / "tests" / "fixtures" / "graphs" / "clean.py")],
    "hf_trainer.py": [str(ROOT / "tests" / "fixtures" / "scripts" / "hf_trainer.py"), "--eval", "--no-mask",
                      "--drop-last", "--output-dir", "out"],  # out: inside the run's temporary folder
    "accelerate_loop.py": [str(ROOT / "tests" / "fixtures" / "scripts" / "accelerate_loop.py")],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=sorted(SCRIPTS), help="time these scripts alone")
    args = parser.parse_args()
    chosen = {name: SCRIPTS[name] for name in (args.only or SCRIPTS)}
    missing = [name for name, (path, *_) in chosen.items() if not Path(path).exists()]
    if missing:
        print(f"skipped, not in this checkout: {', '.join(missing)} (build tests/corpus as tests/corpus/SOURCES.md "
              "says)")
    py = sys.executable
    print(f"{args.repeats} runs per mode (medians), {os.cpu_count()} CPUs, PJRT_DEVICE=CPU")
    print(f"{'script':26} {'plain s':>8} {'check-graphs s':>15} {'ratio':>6} {'CPU s plain':>12} {'CPU s check':>12} "
          f"{'CPU ratio':>9} {'same-emitters s':>16} {'own ratio':>9} {'own CPU':>8}")
    for name, script in ((n, s) for n, s in chosen.items() if n not in missing):
        times: dict[str, list[tuple[float, float]]] = {"plain": [], "check": [], "same": []}
        with tempfile.TemporaryDirectory() as folder:
            for _ in range(args.repeats):
                times["plain"].append(timed([py, *script], Path(folder)))
                times["check"].append(timed([py, "-m", "neuron_train", "check-graphs", "--", py, *script],
                                            Path(folder)))
                times["same"].append(timed([py, *script], Path(folder), {"XLA_FLAGS": CPU_EMITTERS}))
        (plain, plain_cpu), (check, check_cpu), (same, same_cpu) = (
            (statistics.median(w for w, _ in times[m]), statistics.median(c for _, c in times[m]))
            for m in ("plain", "check", "same"))
        print(f"{name:26} {plain:8.1f} {check:15.1f} {check / plain:6.2f} {plain_cpu:12.1f} {check_cpu:12.1f} "
              f"{check_cpu / plain_cpu:9.2f} {same:16.1f} {check / same:9.2f} {check_cpu / same_cpu:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
