"""Shared test helpers. Every test runs on the CPU XLA device; Neuron-only tests are skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_PY = ROOT / "neuron_train" / "run.py"
# Quiet, fast defaults for test runs: no progress bar, no TensorBoard, no worker processes.
FAST = ["--no-progress", "--no-tensorboard", "--num-workers", "0"]
# A one-block ViT that compiles in seconds: for tests of mechanics, not of accuracy.
NANO = ["--model", "vit-nano"]


def cpu_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16",
                                                            "NEURON_EXTRACT_GRAPHS_ONLY")}
    env.update(PJRT_DEVICE="CPU", PYTHONPATH=str(ROOT), **extra)
    return env


def run_train(out: Path, *args: str, nproc: int = 1, env: dict | None = None,
              timeout: int = 900) -> subprocess.CompletedProcess:
    """Run `neuron_train/run.py` (under torchrun when nproc > 1) into run directory `out`."""
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(RUN_PY)]  # --standalone: a free port per run, no collision between test processes
    else:
        cmd = [sys.executable, str(RUN_PY)]
    cmd += ["--output-dir", str(out), *FAST, *args]
    return subprocess.run(cmd, env=env or cpu_env(), capture_output=True, text=True, timeout=timeout)


def printed_json(script: str, *args: str, timeout: int = 600) -> dict:
    """What a `python -c` script printed last, as JSON, from a fresh process on the CPU XLA device."""
    proc = subprocess.run([sys.executable, "-c", script, *args], env=cpu_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def graph(hash: str, phase: str = "train", step: int | None = 0, where: str = "", kind: str = "warmup"):
    """A checker's graph record (neuron_train.graphs.records.Graph) with what coverage reads."""
    from neuron_train.graphs.causes import WARMUP
    from neuron_train.graphs.records import Graph

    return Graph(hash=hash, phase=phase, step=step, compile_time_s=None, kind=kind, cause=WARMUP, detail="",
                 where=where, trigger="sync", site=[where] if where else [], inputs=-1, outputs=-1)


def neuron_present() -> bool:
    return any(Path("/dev").glob("neuron[0-9]*"))


# pytest-timeout for the slow tier: its tests run whole training or check runs, each bounded by its own
# subprocess timeout (up to 1200 s, test_precompile's); pyproject's `timeout` (300 s) is the fast tier's.
SLOW_TIMEOUT_S = 1200


def pytest_collection_modifyitems(config, items):
    # Files with the most slow tests first: with `-n 2 --dist loadfile` (the slow tier's command)
    # workers take whole files in this order, and a long file taken last would run alone at the end.
    slow = Counter(item.path for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.path])  # stable: the order inside a file is kept
    for item in items:
        if "slow" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    if neuron_present():
        return
    skip = pytest.mark.skip(reason="needs a Neuron device (trn1/inf2/inf1)")
    for item in items:
        if item.get_closest_marker("neuron") is not None:  # not `in item.keywords`: a folder named neuron matches that
            item.add_marker(skip)


@pytest.fixture
def in_process_cli(monkeypatch):
    """For CLI calls made in the test's own process: no launcher variables (torchrun's, a Neuron
    extraction's) from the environment, and the run-directory locks released afterwards."""
    from neuron_train.training import rundir

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "PJRT_DEVICE", "NEURON_EXTRACT_GRAPHS_ONLY"):
        monkeypatch.delenv(var, raising=False)
    yield
    rundir.release_unused()
