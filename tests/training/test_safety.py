"""The training loop's safety paths and options, each run for real with its trigger planted.

A safety net that is never seen to catch anything is not known to work: each test here plants the
condition the safety exists for (a learning rate that really diverges, a gradient all-reduce
replaced by a no-op, an LR of exactly 1.0 reaching the graph, a signal) and checks the run stops
the way the README says. Plants that need a code change are test-only launchers written into
tmp_path; nothing in the package has a fault-injection switch. Expected figures are derived here
(by hand from the weights a run saved, or from the files the test wrote), never read back from the
code under test.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from neuron_train.instrument.proc import descendants
from neuron_train.training.checkpoint import list_checkpoints
from neuron_train.training.device import neuron_precision_env, prepare_environment, resolve_precision
from tests.conftest import FAST, NANO, RUN_PY, cpu_env, run_train

# SGD at LR 1e30: the first update scales the weights to ~1e29, and the next forward overflows.
DIVERGING = ["--optimizer", "sgd", "--lr", "1e30", "--grad-clip", "0", "--warmup-steps", "0",
             "--schedule", "constant", "--log-every", "1"]


def launcher(tmp_path: Path, name: str, plant: str, doc: str) -> Path:
    """A test-only `neuron-train train` entry point that applies `plant` first."""
    path = tmp_path / f"{name}.py"
    path.write_text(f'"""TEST-ONLY launcher: {doc}"""\nimport sys\n\n{plant}\n\n'
                    "from neuron_train.cli import main\n\nsys.exit(main(['train', *sys.argv[1:]]))\n")
    return path


def run_script(script: Path, out: Path, *args: str, env: dict | None = None,
               timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(script), "--output-dir", str(out), *FAST, *args]
    return subprocess.run(cmd, env=env or cpu_env(), capture_output=True, text=True, timeout=timeout)


def metrics(out: Path, kind: str = "train") -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


# ----------------------------------------------------------------------------- non-finite loss


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_naming_the_step_and_the_fix(tmp_path):
    out = tmp_path / "nan"
    proc = run_train(out, *NANO, *DIVERGING, "--max-steps", "30", "--eval-every", "100")
    assert proc.returncode == 1, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    first_bad = next(r["step"] for r in metrics(out) if not math.isfinite(r["loss"]))
    assert err == (f"neuron-train train: loss is not finite at step {first_bad}; try a lower --lr, "
                   "--precision fp32 or bf16-autocast, or --grad-clip")
    assert "Traceback" not in proc.stderr
    assert max(r["step"] for r in metrics(out)) < 29  # stopped early, not at the end
    assert not (out / "summary.json").exists()


@pytest.mark.slow
def test_extraction_mode_does_not_stop_on_a_non_finite_loss(tmp_path):
    """Under neuron_parallel_compile the outputs are garbage by design: the run must reach every graph."""
    out = tmp_path / "extract"
    proc = run_train(out, *NANO, *DIVERGING, "--precompile-steps", "5", "--eval-every", "100",
                     env=cpu_env(NEURON_EXTRACT_GRAPHS_ONLY="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(re.search(r"^steps\s+(\d+) ", proc.stdout, re.M).group(1)) == 5
    # The loss it ended on really was not finite: the same settings stop a normal run (test above).
    final = re.search(r"final loss (\S+)", proc.stdout).group(1)
    assert not math.isfinite(float(final)), proc.stdout


# ----------------------------------------------------------------------------- check-graphs

LR_ONE = "from neuron_train.training import optim\n\noptim.xla_safe = lambda lr: lr  # the guard removed"


@pytest.mark.slow
def test_check_graphs_fails_the_run_on_a_recompilation_inside_the_loop(tmp_path):
    """With the LR guard removed, a cosine schedule peaking at --lr 1 hands SGD exactly 1.0 at step 5
    (`param.add_(buf, alpha=-lr)`), a value XLA bakes into the graph as a constant: a new graph after
    warm-up. (Step 5, not 3: the checker judges warmth per call site, and the loop's measurement sync
    after step 2 runs that step's graph at another site, so the loader's site first repeats at step 3.)"""
    script = launcher(tmp_path, "lr_one", LR_ONE, "the LR schedule may return exactly 1.0")
    out = tmp_path / "run"
    # --step-compiler lazy: the LR reaches a lazily traced update as a Python scalar (a captured one
    # takes it as a device tensor, where 1.0 is data like any other value).
    proc = run_script(script, out, *NANO, "--check-graphs", "--step-compiler", "lazy", "--optimizer", "sgd",
                      "--lr", "1", "--min-lr", "0.1",
                      "--warmup-steps", "5", "--schedule", "cosine", "--max-steps", "8",
                      "--eval-every", "100")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"neuron-train train: recompilation after warm-up at step (\d+) \(train\): (.+) "
                     r"at (\S+):(\d+) \[(.*)\]; fix: (.+)", last)
    assert m, last
    step, cause, path, line, detail, fix = m.groups()
    assert (int(step), cause) == (5, "new constant"), last
    # the line of our loop where the LR reaches the graph, and the value that did it
    assert "/neuron_train/training/" in path, last
    assert "self.optimizer.step()" in Path(path).read_text().splitlines()[int(line) - 1], last
    assert "param_groups[0]['lr'] = 1.0" in detail
    assert "avoid the exact values 0 and 1" in fix
    assert "Traceback" not in proc.stderr and not (out / "summary.json").exists()


# ----------------------------------------------------------------------------- signals


@pytest.mark.slow
def test_sigusr1_saves_a_checkpoint_and_exits_like_sigterm(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, str(RUN_PY), "--output-dir", str(out), *FAST, *NANO, "--max-steps", "400",
           "--eval-every", "1000", "--log-every", "1"]
    proc = subprocess.Popen(cmd, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not ((out / "metrics.jsonl").exists() and len(metrics(out)) >= 3):
        assert proc.poll() is None and time.time() < deadline, "the run ended before 3 logged steps"
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-2000:]
    (saved,) = list_checkpoints(out)
    step = int(saved.stem.split("-")[1])
    assert 3 <= step < 400
    assert err.strip().splitlines()[-1] == ("neuron-train train: stopped by SIGUSR1 at "
                                            f"step {step}; checkpoint {saved}; continue with --resume")
    state = torch.load(saved, weights_only=True)
    assert state["position"]["step"] == step and not (out / "summary.json").exists()


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of the torchrun worker below `parent` whose environment says RANK=`rank`."""
    for pid in descendants(parent):  # parents first: the worker before any process it started
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:  # gone meanwhile
            continue
    return None


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step_with_one_checkpoint(tmp_path):
    """torchrun and srun signal the ranks one by one, so a rank may see the signal a step before the
    others. Planted at its extreme: SIGTERM to rank 1 alone. Every rank must stop at the same step
    boundary (a rank going on alone waits forever in its next collective) with rank 0's checkpoint."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--redirects", "3", "--log-dir", str(logs), str(RUN_PY), "--output-dir", str(out), *FAST, *NANO,
           "--max-steps", "400", "--eval-every", "1000", "--log-every", "1"]
    proc = subprocess.Popen(cmd, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks: list[int | None] = []
    try:
        deadline = time.time() + 600
        while not ((out / "metrics.jsonl").exists() and len(metrics(out)) >= 3):
            assert proc.poll() is None and time.time() < deadline, "the run ended before 3 logged steps"
            time.sleep(0.2)
        ranks = [_rank_pid(proc.pid, rank) for rank in (0, 1)]
        assert ranks[1] is not None, "no rank 1 process below torchrun"
        os.kill(ranks[1], signal.SIGTERM)
        proc.communicate(timeout=120)  # seconds when the ranks agree; without it they wait forever
    finally:  # a run that hangs is killed whole: torchrun starts each rank in a session of its own
        for pid in [pid for pid in (*ranks, proc.pid) if pid is not None]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=60)
    err = {rank: next(logs.glob(f"**/{rank}/stderr.log")).read_text() for rank in (0, 1)}
    (saved,) = list_checkpoints(out)
    step = int(saved.stem.split("-")[1])
    assert 3 <= step < 400 and torch.load(saved, weights_only=True)["position"]["step"] == step
    assert (f"stopped by a stop signal to another rank at step {step}; checkpoint {saved}; "
            "continue with --resume") in err[0], err[0][-2000:]
    assert f"stopped by SIGTERM at step {step}; checkpoint saved by rank 0" in err[1], err[1][-2000:]
    assert "Traceback" not in err[0] + err[1] and not (out / "summary.json").exists()


# ----------------------------------------------------------------------------- bf16 on Neuron


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16", "xla-use-bf16", "xla-downcast-bf16"])
@pytest.mark.parametrize("device", ["NEURON", "CPU"])
def test_stochastic_rounding_is_asked_for_every_bf16_mode_on_neuron_only(precision, device):
    expected = {"NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"} if device == "NEURON" and precision != "fp32" else {}
    assert neuron_precision_env(precision, device) == expected


def test_prepare_environment_sets_stochastic_rounding_unless_the_user_chose(monkeypatch):
    monkeypatch.setattr(os, "environ", {"PJRT_DEVICE": "NEURON"})
    assert prepare_environment("bf16") == "bf16"
    assert os.environ["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
    monkeypatch.setattr(os, "environ", {"PJRT_DEVICE": "NEURON", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"})
    prepare_environment("bf16")
    assert os.environ["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "0"
    monkeypatch.setattr(os, "environ", {"PJRT_DEVICE": "CPU"})
    prepare_environment("bf16")
    assert "NEURON_RT_STOCHASTIC_ROUNDING_EN" not in os.environ


def test_resolve_precision_gives_the_config_the_precision_the_run_uses(monkeypatch):
    """The one precision rule of train, bench and plan: the legacy variable from the shell decides,
    else --precision; the run's config (saved, reported) holds the result, the given one is unchanged."""
    from neuron_train.common.errors import UsageError
    from neuron_train.training.config import RunConfig, TrainConfig

    monkeypatch.setattr(os, "environ", {"PJRT_DEVICE": "CPU"})
    autocast = RunConfig(train=TrainConfig(precision="bf16-autocast"))
    assert resolve_precision(autocast) == autocast and "XLA_USE_BF16" not in os.environ
    legacy = RunConfig(train=TrainConfig(precision="xla-downcast-bf16", batch_size=8))
    assert resolve_precision(legacy) == legacy and os.environ["XLA_DOWNCAST_BF16"] == "1"
    monkeypatch.setattr(os, "environ", {"PJRT_DEVICE": "CPU", "XLA_USE_BF16": "1"})
    fp32 = RunConfig(train=TrainConfig(batch_size=8))
    resolved = resolve_precision(fp32)
    assert resolved.train == TrainConfig(batch_size=8, precision="xla-use-bf16") and fp32.train.precision == "fp32"
    with pytest.raises(UsageError,
                       match="XLA_USE_BF16=1 is set in the environment, which conflicts with --precision bf16"):
        resolve_precision(RunConfig(train=TrainConfig(precision="bf16")))


# ----------------------------------------------------------------------------- diverged replicas

NO_REDUCE = ("from neuron_train.training.device import Backend\n\n"
             "Backend.reduce_gradients = lambda self, optimizer: None  # every rank keeps its own gradients")


@pytest.mark.slow
def test_diverged_replicas_stop_a_two_rank_run_and_only_rank_0_draws_a_progress_bar(tmp_path):
    script = launcher(tmp_path, "no_reduce", NO_REDUCE, "the gradient all-reduce is a no-op")
    out, logs = tmp_path / "run", tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--redirects", "3", "--log-dir", str(logs), str(script), "--output-dir", str(out), *FAST,
           *NANO, "--max-steps", "3", "--eval-every", "100", "--progress"]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0, proc.stderr[-3000:]
    err = {rank: next(logs.glob(f"**/{rank}/stderr.log")).read_text() for rank in (0, 1)}
    for rank in (0, 1):
        assert re.search(r"data-parallel replicas diverged \(parameter checksums \[\S+, \S+\]\): "
                         r"gradients were not averaged over all ranks", err[rank]), err[rank][-2000:]
        assert "Traceback" not in err[rank]
    assert not (out / "summary.json").exists()
    bar = re.compile(r"\b3/3 \[")
    assert bar.search(err[0]) and not re.search(r"\d+/3 \[", err[1]), (err[0][-800:], err[1][-800:])
