"""Training guards that each killed a mutant the rest of the suite let through (issue 22):
a checkpoint save killed for real mid-write, 2 ranks x B against 1 rank x 2B with plain SGD, and
resume with randomness that changes the weights (drop-path). docs/measurements.md lists each mutant.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from neuron_train.training import checkpoint as ckpt
from tests.conftest import NANO, cpu_env, run_train, summary_of
from tests.training.test_train import assert_same_weights, final_weights, resume_ends_like_the_full_run

pytestmark = pytest.mark.slow  # every test starts training processes (run.py, torchrun, a killed save)

SAVE_TWICE = """
import sys, torch
from pathlib import Path
from neuron_train.training import checkpoint as ckpt
run = Path(sys.argv[1])
big = {"model": {f"w{i}": torch.ones(16 * 2**20) for i in range(8)}, "step": 2}  # 8 x 64 MiB
print("writing 2", flush=True)
ckpt.save(run, 2, big, keep_last=3)
print("saved 2", flush=True)
"""


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_whole_and_no_partial_one(tmp_path):
    """M13. SIGKILL while a 512 MiB checkpoint is being written: no torn step-2 among the
    checkpoints, step 1 loads with its contents, and the next start removes the leftover."""
    run = tmp_path / "run"
    first = ckpt.save(run, 1, {"model": {"w": torch.arange(10.0)}, "step": 1}, keep_last=3)
    child = subprocess.Popen([sys.executable, "-c", SAVE_TWICE, str(run)], env=cpu_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "writing 2\n", child.stderr.read()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the second file is being written (about 1 MiB out)
        partial = [p for p in ckpt.checkpoint_dir(run).iterdir() if p != first and p.stat().st_size > 2**20]
        if partial:
            break
        time.sleep(0.001)
    child.send_signal(signal.SIGKILL)
    out, _ = child.communicate(timeout=60)
    assert partial and child.returncode == -signal.SIGKILL and "saved 2" not in out
    assert partial[0].stat().st_size < 8 * 64 * 2**20  # killed mid-write, not after it

    assert ckpt.list_checkpoints(run) == [first]
    state = ckpt.load(first)
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.arange(10.0))
    assert (ckpt.remove_stale_temps(run) == partial
            and sorted(os.listdir(ckpt.checkpoint_dir(run))) == [first.name, first.name + ".sha256"])


SGD = ["--optimizer", "sgd", "--momentum", "0", "--weight-decay", "0", "--grad-clip", "0",
       "--schedule", "constant", "--warmup-steps", "0", "--lr", "0.5", "--max-steps", "4", "--eval-every", "100"]


def test_two_ranks_of_b_train_exactly_like_one_rank_of_2b_with_plain_sgd(tmp_path):
    """M26. Plain SGD (no momentum, decay or clipping) moves weights by LR x gradient: a summed
    instead of averaged gradient over 2 ranks doubles every update."""
    two = run_train(tmp_path / "two", *NANO, *SGD, "--batch-size", "16", nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_train(tmp_path / "one", *NANO, *SGD, "--batch-size", "32")
    assert one.returncode == 0, one.stderr[-3000:]
    assert summary_of(tmp_path / "two")["global_batch_size"] == summary_of(tmp_path / "one")["global_batch_size"] == 32
    assert_same_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"), atol=1e-6)


def test_resume_restores_the_random_state_drop_path_draws_from(tmp_path):
    """M27. With drop-path (stochastic depth) each step's weights depend on the random masks: a run
    resumed from step 4 ends with the uninterrupted run's weights only if the RNG came back too.
    vit-digits: 4 blocks (timm spreads the rate over the depth; vit-nano's single block gets 0)."""
    args = ["--model", "vit-digits", "--drop-path", "0.5", "--max-steps", "8", "--checkpoint-every", "4",
            "--eval-every", "100", "--warmup-steps", "2"]
    resumed = resume_ends_like_the_full_run(tmp_path, args, at_step=4)
    assert summary_of(resumed)["resumed_from"].endswith("step-00000004.pt")
