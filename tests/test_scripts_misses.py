"""check-graphs on the Trainer shapes of issue 43's held-out misses (tests/fixtures/scripts/hf_trainer.py:
a registry transformers, a tiny random BERT, local random tokens): each finding names the setting or the
line the user can change, and the fix it prints, applied, removes it."""

from __future__ import annotations

import sys

import pytest
from test_graphs import check_graphs
from test_scripts import HF, label

from neuron_train.graphs import records

pytestmark = pytest.mark.slow  # every test runs check-graphs on a Trainer script: processes


def late_causes(report: dict) -> list[str]:
    return [g["cause"] for g in report["late_graphs"]]


def test_a_gradient_accumulation_remainder_names_the_setting_the_arithmetic_and_a_fix_that_removes_it(tmp_path):
    """gradient_accumulation_steps=3 with 10 batches an epoch (80 samples of 8): the last window of each
    epoch has 1 batch, a step graph of its own at the Trainer's end-of-epoch mark_step. At 72 samples (the
    first fix printed: 9 batches) every window has 3 and that graph is gone."""
    command = (sys.executable, str(HF), "--no-mask", "--arg", "gradient_accumulation_steps=3")
    code, report, output = check_graphs(tmp_path, *command, "--samples", "80", "--output-dir", str(tmp_path / "o"))
    [remainder] = [g for g in report["late_graphs"] if g["cause"] == records.ACCUMULATION_REMAINDER]
    assert remainder["where"] == label(HF, "TRAIN") and remainder["library"].startswith("transformers/trainer.py:")
    assert "gradient_accumulation_steps=3) with 10 batches an epoch" in remainder["detail"]
    assert "windows of 3, 3, 3, 1 batches" in remainder["detail"], output
    assert remainder["fix"].startswith("make the batches per epoch a multiple of 3 (9 or 12 batches: 72 or 96")
    code, report, output = check_graphs(tmp_path, *command, "--samples", "72", "--output-dir", str(tmp_path / "o2"))
    assert code == 0 and late_causes(report) == [] and report["recompiles"] == [], output
