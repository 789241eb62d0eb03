"""check-graphs on the Trainer shapes of issue 43's held-out misses (tests/fixtures/scripts/hf_trainer.py:
a registry transformers, a tiny random BERT, local random tokens): each finding names the setting or the
line the user can change, and the fix it prints, applied, removes it."""

from __future__ import annotations

import re
import shlex
import sys

import pytest

from neuron_train.graphs import causes
from tests.graphs.test_graphs import check_graphs
from tests.graphs.test_scripts import HF, label
from tests.instrument.test_byos import nt

pytestmark = pytest.mark.slow  # every test runs check-graphs on a Trainer script: processes


def late_causes(report: dict) -> list[str]:
    return [g["cause"] for g in report["late_graphs"]]


def test_a_gradient_accumulation_remainder_names_the_setting_the_arithmetic_and_a_fix_that_removes_it(tmp_path):
    """gradient_accumulation_steps=3 with 10 batches an epoch (80 samples of 8): the last window of each
    epoch has 1 batch, a step graph of its own at the Trainer's end-of-epoch mark_step. At 72 samples (the
    first fix printed: 9 batches) every window has 3 and that graph is gone."""
    command = (sys.executable, str(HF), "--no-mask", "--arg", "gradient_accumulation_steps=3")
    code, report, output = check_graphs(tmp_path, *command, "--samples", "80", "--output-dir", str(tmp_path / "o"))
    [remainder] = [g for g in report["late_graphs"] if g["cause"] == causes.ACCUMULATION_REMAINDER]
    assert remainder["where"] == label(HF, "TRAIN") and remainder["library"].startswith("transformers/trainer.py:")
    assert "gradient_accumulation_steps=3) with 10 batches an epoch" in remainder["detail"]
    assert "windows of 3, 3, 3, 1 batches" in remainder["detail"], output
    assert remainder["fix"].startswith("make the batches per epoch a multiple of 3 (9 or 12 batches: 72 or 96")
    code, report, output = check_graphs(tmp_path, *command, "--samples", "72", "--output-dir", str(tmp_path / "o2"))
    assert code == 0 and late_causes(report) == [] and report["recompiles"] == [], output


def test_a_trainers_ragged_last_batch_is_a_recompilation_with_its_arithmetic_and_a_fix_that_removes_it(tmp_path):
    """30 samples in batches of 8, dataloader_drop_last=False: each epoch ends with a batch of 6, whose step
    graph the Trainer syncs at its end-of-epoch mark_step (a new call site: every full batch's step is synced
    by the loader's next fetch). Named a ragged-batch recompilation at the DataLoader the Trainer made, not a
    late graph; with --drop-last (dataloader_drop_last=True, the first fix printed) nothing new compiles."""
    command = (sys.executable, str(HF), "--no-mask", "--samples", "30")
    code, report, output = check_graphs(tmp_path, *command, "--output-dir", str(tmp_path / "o"))
    assert code == 1 and late_causes(report) == [], output
    [ragged] = report["recompiles"]
    assert (ragged["cause"], ragged["where"]) == (causes.NEW_INPUT_SHAPE, label(HF, "TRAIN")), output
    assert ragged["library"].startswith("transformers/trainer.py:"), output
    assert "a ragged last batch: 30 samples in batches of 8 (drop_last=False)" in ragged["detail"], output
    assert "3 full batches and a last one of 30 mod 8 = 6" in ragged["detail"], output
    assert "s64[8,8] -> s64[6,8]" in ragged["detail"], output
    assert ragged["fix"].startswith("TrainingArguments(dataloader_drop_last=True)"), output
    assert "a multiple of 8 (24 or 32 samples)" in ragged["fix"] and "precompile it" in ragged["fix"], output
    code, report, output = check_graphs(tmp_path, *command, "--drop-last", "--output-dir", str(tmp_path / "o2"))
    assert code == 0 and late_causes(report) == [] and report["recompiles"] == [], output


def test_a_callbacks_dropout_anneal_to_exactly_0_is_named_at_the_write_and_its_fix_passes(tmp_path):
    """A TrainerCallback anneals every nn.Dropout.p to exactly 0 by optimizer step 4: the step after is a
    new graph, named at the callback's write (not the Trainer's batch fetch from trainer.train()), with
    the fix to end the anneal above 0; --anneal-dropout 1e-6 (that fix) is stable."""
    command = (sys.executable, str(HF), "--no-mask", "--drop-last")
    code, report, output = check_graphs(tmp_path, *command, "--anneal-dropout", "--output-dir", str(tmp_path / "o"))
    assert code == 1, output
    [written] = report["recompiles"]
    assert (written["cause"], written["where"], written["library"]) == (
        causes.NEW_CONSTANT, label(HF, "DROPOUT"), ""), output
    assert "Dropout.p = 0.0 written at" in written["detail"] and "max(1e-6, ...)" in written["fix"]
    code, report, output = check_graphs(tmp_path, *command, "--anneal-dropout", "1e-6",
                                        "--output-dir", str(tmp_path / "o2"))
    assert code == 0 and report["recompiles"] == [], output


def test_the_trainers_loss_log_names_logging_steps_and_a_realistic_interval_passes(tmp_path):
    """logging_steps=2: the Trainer reads the loss (through xm.mesh_reduce in transformers/trainer_pt_utils.py)
    every second optimizer step: half of them, a failure named by the argument the user sets, counted per
    optimizer step. logging_steps=4: reported with the same fix, not a failure."""
    command = (sys.executable, str(HF), "--no-mask", "--drop-last", "--samples", "64")
    code, report, output = check_graphs(tmp_path, *command, "--arg", "logging_steps=2",
                                        "--output-dir", str(tmp_path / "o"))
    assert code == 1, output
    [log] = [h for h in report["host_syncs"] if h["executes_graph"]]
    assert log["library"].startswith("transformers/") and log["every_step"], output
    assert log["fix"].startswith("TrainingArguments(logging_steps=2) makes the Trainer read the loss")
    assert log["logging_steps"] == 2, output
    [problem] = report["problems"]
    assert "optimizer steps after warm-up: the Trainer's loss log, TrainingArguments(logging_steps=2)" in problem
    code, report, output = check_graphs(tmp_path, *command, "--arg", "logging_steps=4",
                                        "--output-dir", str(tmp_path / "o2"))
    assert code == 0, output
    [log] = [h for h in report["host_syncs"] if h["executes_graph"]]
    assert not log["every_step"] and log["fix"].startswith("TrainingArguments(logging_steps=4)")


def test_a_trainer_script_that_evaluates_after_training_is_precompiled_to_its_end_and_fully_covered(tmp_path):
    """trainer.evaluate() after trainer.train(), 3 epochs: the default tour fast-forwards once every call
    site is warm past the first epoch (the Trainer told to stop training), reaches the final evaluation,
    and the printed "then run" command passes at 100% coverage."""
    command = [sys.executable, str(HF), "--no-mask", "--drop-last", "--final-eval", "--epochs", "3",
               "--output-dir", str(tmp_path / "out")]
    proc = nt(tmp_path, "precompile", "--cache-dir", "cc", "--", *command)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "the Trainer told to stop training" in out and "final evaluation:" in out, out
    assert re.search(r"tour +fast-forwarded after step \d+ .* the code after its training loop included", out), out
    then_run = shlex.split(re.search(r"then run +(.*)", out).group(1))
    proc = nt(tmp_path, *then_run[1:])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"precompile coverage 100% \((\d+)/\1 graphs", proc.stdout), proc.stdout
    assert "'epoch': 3.0" in proc.stdout  # the real run trained all 3 epochs, then evaluated
