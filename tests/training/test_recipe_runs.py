"""timm's recipe end to end: the loop's own guard, precompile coverage, and check-graphs catching
timm's stock CutMix applied on the device (the in-process rules are in test_recipe.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import FAST, NANO, cpu_env, run_train, summary_of
from tests.training.test_train import resume_ends_like_the_full_run

RECIPE = ["--aa", "rand-m9-mstd0.5-inc1", "--reprob", "0.25", "--mixup", "0.8", "--cutmix", "1.0",
          "--smoothing", "0.1", "--model-ema", "--model-ema-decay", "0.99"]
TRAIN = [*NANO, "--max-steps", "6", "--eval-every", "3"]

STOCK_CUTMIX = '''
import torch
import torch_xla
from timm.data import Mixup

dev = torch_xla.device()
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 10)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mixup_fn = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=10)
for step in range(8):
    x, y = torch.randn(8, 3, 16, 16).to(dev), torch.randint(0, 10, (8,)).to(dev)
    x, target = mixup_fn(x, y)  # timm's CutMix on device tensors: a box of a new size each batch
    loss = torch.sum(-target * torch.log_softmax(model(x), -1), -1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()
'''


@pytest.mark.slow
def test_the_full_recipe_passes_the_loops_guard_with_as_many_graphs_as_without(tmp_path):
    plain = run_train(tmp_path / "plain", *TRAIN, "--check-graphs")
    recipe = run_train(tmp_path / "recipe", *TRAIN, "--check-graphs", *RECIPE)
    for proc in (plain, recipe):
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    s, base = summary_of(tmp_path / "recipe"), summary_of(tmp_path / "plain")
    graphs = json.loads((tmp_path / "recipe" / "graphs.json").read_text())
    assert graphs["stable"] and graphs["recompiles"] == [], graphs["problems"]
    # the EMA's update is captured into the update's graph (before issue 45, a graph of its own: one more);
    # its evaluation reuses the eval graph
    assert s["compile_count"] == base["compile_count"], (s["compile_count"], base["compile_count"])
    assert 0.0 <= s["eval_ema_accuracy"] <= 1.0 and "EMA accuracy" in recipe.stdout


@pytest.mark.slow
def test_precompile_covers_the_recipes_graphs_ema_evaluation_included(tmp_path):
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "neuron_train", "precompile", "--target", "cpu", "--cache-dir", str(cache),
           "--", *TRAIN, *FAST, *RECIPE]
    pre = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=1200)
    assert pre.returncode == 0, pre.stdout[-3000:] + pre.stderr[-3000:]
    out = tmp_path / "run"
    proc = run_train(out, *TRAIN, *RECIPE, "--compile-cache", str(cache), "--require-precompiled")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((out / "precompile_coverage.json").read_text())
    assert summary_of(out)["precompile_coverage"] == 1.0 and report["missing"] == [], report
    assert "eval_ema_accuracy" in summary_of(out)


def check_stock_cutmix(tmp_path) -> str:
    script = tmp_path / "stock_cutmix.py"
    script.write_text(STOCK_CUTMIX)
    proc = subprocess.run([sys.executable, "-m", "neuron_train", "check-graphs", "--", sys.executable, str(script)],
                          env=cpu_env(), capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_timms_stock_cutmix_on_the_device_is_caught_by_check_graphs(tmp_path):
    out = check_stock_cutmix(tmp_path)
    assert "verdict: NOT graph-stable" in out
    assert "first difference xla::unselect pred[8,3," in out  # the box's assignment, a new shape


@pytest.mark.slow
def test_check_graphs_names_timms_cutmix_slice_and_the_host_side_fix(tmp_path):
    """Named at timm's slicing line (the op that differs was traced there), then the user's sync that
    ran it; every new box counts from the second batch (7 of 8 batches draw a new one), with the fix
    that works: mix on the host."""
    out = check_stock_cutmix(tmp_path)
    assert "slice-made shape at timm/data/mixup.py:" in out and ", from stock_cutmix.py:17" in out, out
    assert "apply Mixup/CutMix on the host, in the data loader" in out and "--cutmix" in out
    assert "recompilations (new graphs at warm call sites): 0" not in out
    assert "#2 " in out and "  step     2  main       recompile" in out, out


@pytest.mark.slow
def test_resume_continues_the_ema_and_refuses_a_checkpoint_without_one(tmp_path):
    """A run resumed from step 2 ends with the uninterrupted run's EMA figures only if the checkpoint
    held the EMA weights (a fresh EMA would start from the step-2 weights)."""
    from neuron_train.training import checkpoint as ckpt

    args = [*NANO, "--max-steps", "4", "--checkpoint-every", "2", "--eval-every", "100",
            "--model-ema", "--model-ema-decay", "0.5"]
    full = run_train(tmp_path / "full", *args)
    assert full.returncode == 0, full.stderr[-3000:]
    resumed = run_train(tmp_path / "resumed", *args, "--resume",
                        str(ckpt.checkpoint_dir(tmp_path / "full") / "step-00000002.pt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = summary_of(tmp_path / "full"), summary_of(tmp_path / "resumed")
    assert b["eval_ema_loss"] == pytest.approx(a["eval_ema_loss"], abs=1e-5), (a["eval_ema_loss"], b["eval_ema_loss"])
    plain = run_train(tmp_path / "plain", *NANO, "--max-steps", "2")
    assert plain.returncode == 0, plain.stderr[-3000:]
    refused = run_train(tmp_path / "refused", *NANO, "--max-steps", "4", "--model-ema", "--resume",
                        str(ckpt.checkpoint_dir(tmp_path / "plain") / "step-00000002.pt"))
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "holds no EMA weights (saved without --model-ema)" in refused.stderr


@pytest.mark.slow
def test_the_ema_of_a_batchnorm_model_copies_its_counts_under_the_captured_update(tmp_path):
    """dynamo-full's AdamW graph changes no input; the EMA's integer buffers (BatchNorm's
    num_batches_tracked) are copied in place after it, traced: after 3 steps they are the model's 3."""
    import torch

    from neuron_train.training.checkpoint import list_checkpoints

    out = tmp_path / "run"
    proc = run_train(out, "--model", "resnet10t", "--img-size", "32", "--batch-size", "8", "--max-steps", "3",
                     "--eval-every", "100", "--model-ema", "--model-ema-decay", "0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary_of(out)["eval_ema_accuracy"] is not None
    state = torch.load(list_checkpoints(out)[-1], weights_only=True)
    counts = {k: v for k, v in state["model_ema"].items() if k.endswith("num_batches_tracked")}
    assert counts and all(int(v) == 3 for v in counts.values()), counts
    assert all(int(state["model"][k]) == 3 for k in counts)


@pytest.mark.slow
def test_loader_workers_mix_each_batch_as_the_main_process_does():
    """Batch k of an epoch goes to worker k % workers (the DataLoader hands batches out in turn):
    each batch's draw is the same with 0 or 2 workers, so a resume may change --num-workers."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    from neuron_train.training.augment import SoftTargetCollate
    from neuron_train.training.config import RecipeConfig

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, 8, 8, generator=g), i % 10) for i in range(64)]
    collate = SoftTargetCollate(RecipeConfig(mixup=0.8, cutmix=1.0), 10, seed=1)
    np.random.seed(0)
    runs = [[t for _, t in DataLoader(data, batch_size=8, num_workers=workers,
                                      collate_fn=collate.at(rank=0, epoch=0, first_batch=0))]
            for workers in (0, 2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.slow
def test_a_resumed_run_mixes_its_batches_as_the_uninterrupted_run_did(tmp_path):
    """Mixup/CutMix draws per batch, seeded by (seed, rank, epoch, batch): resumed mid-epoch from
    step 3, the run ends with the uninterrupted run's weights. (With numpy's global state, re-seeded
    at start-up, the resumed steps got the first steps' draws.)"""
    args = [*NANO, "--max-steps", "6", "--checkpoint-every", "3", "--eval-every", "100", "--mixup", "0.8",
            "--cutmix", "1.0"]
    resume_ends_like_the_full_run(tmp_path, args, at_step=3)


@pytest.mark.slow
def test_a_resumed_run_augments_its_samples_as_the_uninterrupted_run_did(tmp_path):
    """RandAugment and random erasing draw per sample from generators seeded by (seed, epoch, sample
    index) (augment.AugmentedTensors): resumed mid-epoch from step 3, the run ends with the
    uninterrupted run's weights. (Drawn from the global generators, which the step's thread moves
    too, two runs with one seed parted within 40 steps, and a resume could not repeat them.)"""
    args = [*NANO, "--max-steps", "6", "--checkpoint-every", "3", "--eval-every", "100",
            "--aa", "rand-m9-mstd0.5-inc1", "--reprob", "0.5"]
    resume_ends_like_the_full_run(tmp_path, args, at_step=3)


@pytest.mark.slow
def test_a_bf16_run_evaluates_and_resumes_its_float32_ema(tmp_path):
    """--precision bf16 --model-ema: the EMA (float32) is evaluated beside the raw weights, and a run
    resumed from step 2 ends with the uninterrupted run's weights and EMA figures."""
    args = [*NANO, "--max-steps", "4", "--checkpoint-every", "2", "--eval-every", "2", "--precision", "bf16",
            "--model-ema", "--model-ema-decay", "0.5"]
    resumed = resume_ends_like_the_full_run(tmp_path, args, at_step=2)
    a, b = summary_of(tmp_path / "full"), summary_of(resumed)
    assert (a["eval_ema_accuracy"], a["eval_ema_loss"]) == (b["eval_ema_accuracy"], b["eval_ema_loss"])
