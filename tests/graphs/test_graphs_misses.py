"""check-graphs on the shapes of the held-out misses of issue 43 (own fixtures under
tests/fixtures/graphs/, each line to name labelled `# <- LABEL`)."""

from __future__ import annotations

import pytest

from neuron_train.graphs import causes
from tests.graphs.test_graphs import check_script, line_of


@pytest.mark.slow
def test_an_lr_starting_at_exactly_1_with_a_steplr_is_a_recompilation_from_a_constant(tmp_path):
    """Epoch 2's step graph takes the LR (0.7) as data where epoch 1's baked 1.0 in; the evaluation's
    `.item()` reads in the same window are not the cause. At --lr 0.5 nothing new compiles."""
    code, report, output = check_script(tmp_path, "lr_from_one.py")
    assert code == 1, output
    [moved] = report["recompiles"]
    assert (moved["cause"], moved["where"]) == (causes.NEW_CONSTANT, line_of("lr_from_one.py", "SCHEDULER"))
    assert "['lr'] = 0.7, set by the StepLR" in moved["detail"]
    assert moved["fix"].startswith("start lr away from exactly 0 and 1")
    code, report, output = check_script(tmp_path, "lr_from_one.py", "--lr", "0.5")
    assert code == 0 and report["recompiles"] == [], output


@pytest.mark.slow
def test_a_fallback_ops_data_dependent_length_is_named_at_the_users_call_and_its_fix_passes(tmp_path):
    """torch.unique(..., return_counts=True) for class weights: its input is ready, so no graph runs for
    it and no read names it; the recompilation when a batch has 2 classes instead of 3 is a data-dependent
    shape at the user's call (never torch/functional.py), with a fixed-length fix (not drop_last: every
    batch is full); the fallback op carries that line. The fix applied: stable."""
    code, report, output = check_script(tmp_path, "unique_counts.py")
    assert code == 1, output
    unique = line_of("unique_counts.py", "UNIQUE")
    [shape] = report["recompiles"]
    assert (shape["cause"], shape["where"], shape["library"]) == (causes.DATA_DEPENDENT, unique, ""), output
    assert "one_hot(labels, num_classes).sum(0)" in shape["fix"] and "drop_last" not in shape["fix"]
    assert report["fallback_ops"]["aten::_unique2"]["where"] == [unique]
    assert "torch/functional.py" not in output
    code, report, output = check_script(tmp_path, "unique_counts.py", "--fixed")
    assert code == 0 and report["recompiles"] == [], output


@pytest.mark.slow
def test_a_slice_of_a_device_corpus_at_a_moving_offset_is_named_at_the_slice_and_its_fix_passes(tmp_path):
    """word_language_model's get_batch on a device-resident corpus: graphs whose HLO differs only in a
    slice's bounds are named (never "unknown" with a fix that sends the user back to the checker), at the
    slice, with the host-side fix; --host (that fix) is stable."""
    code, report, output = check_script(tmp_path, "device_corpus.py")
    assert code == 1, output
    found = report["recompiles"]
    assert found and all((g["cause"], g["where"]) == (causes.SLICE_OFFSET, line_of("device_corpus.py", "SLICE"))
                         for g in found), output
    assert "{[10:15], [0:8]} -> {[15:20], [0:8]}" in found[0]["detail"] and "on the host" in found[0]["fix"]
    assert causes.UNKNOWN not in output and "check-graphs -- COMMAND" not in output
    code, report, output = check_script(tmp_path, "device_corpus.py", "--host")
    assert code == 0 and report["recompiles"] == [], output


@pytest.mark.slow
def test_fsdps_one_time_graph_after_the_first_evaluation_is_named_at_the_training_sync(tmp_path):
    code, report, output = check_script(tmp_path, "fsdp_eval.py")
    assert code == 1, output
    [after] = report["recompiles"]
    assert (after["cause"], after["where"]) == (causes.FSDP_AFTER_EVAL, line_of("fsdp_eval.py", "TRAIN_SYNC"))
    assert "optimization barrier" in after["detail"] and "pad to the maximum length" not in output
