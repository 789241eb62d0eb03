"""summary.json read back as a typed record (training/summary.py): by `train` to print it, by bench
(cost/bench/measure.py) to measure it. A summary of a real run: tests/training/test_train.py; here the reader's
contract on the file."""

from __future__ import annotations

import json

import pytest

from neuron_train.common.errors import RunError
from neuron_train.training.summary import RunSummary

WRITTEN = {  # the keys loop.py writes for a short CPU run, trimmed to what a reader uses + two extras
    "model": "vit-nano", "params": 123456, "device": "CPU", "precision": "fp32", "world_size": 2,
    "batch_size": 8, "global_batch_size": 16, "steps": 6, "epochs": 0.5, "samples_per_sec": 321.5,
    "step_time_ms_median": 49.75, "step_time_ms_spread": 1.5, "measured_steps": 3, "warmup_steps_excluded": 3,
    "wall_time_s": 12.0, "compile_count": 4, "compile_time_s": 2.5, "precompile_coverage": None,
    "xla_execute_ms_median": 10.0, "final_loss": 2.0, "eval_accuracy": 0.25, "eval_loss": 2.1,
    "param_checksums": [], "resumed_from": None, "run_dir": "runs/x", "zero1": False,
}


def test_a_summary_file_round_trips_with_its_extra_keys(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(WRITTEN))
    s = RunSummary.from_json(path)
    assert (s.samples_per_sec, s.global_batch_size, s.device, s.eval_accuracy) == (321.5, 16, "CPU", 0.25)
    assert s.extra == {"zero1": False}
    assert json.dumps(s.to_json()) == json.dumps(WRITTEN)  # byte for byte: the same keys in the same order


def test_the_loops_summary_is_written_as_before_it_was_a_record():
    """loop.py builds the record; the file has the keys the dict had, in its order, with no eval figure
    for a run without a validation set (not null) and the profile's bottleneck after the extras."""
    fields = {k: v for k, v in WRITTEN.items() if k not in ("eval_accuracy", "eval_loss", "zero1")}
    s = RunSummary(**fields, extra={"zero1": False, "bottleneck": None})
    assert json.dumps(s.to_json()) == json.dumps({**fields, "zero1": False, "bottleneck": None})


def test_a_too_short_run_has_no_speed_figures():
    s = RunSummary.from_json({**WRITTEN, "samples_per_sec": None, "step_time_ms_median": None})
    assert s.samples_per_sec is None and s.step_time_ms_median is None


@pytest.mark.parametrize("content, message", [
    ({k: v for k, v in WRITTEN.items() if k not in ("compile_count", "device")},
     "lacks device, compile_count: not a summary.json of this neuron-train version"),
    ([1, 2], "is not a JSON object"),
])
def test_a_file_that_is_not_a_summary_is_one_clear_error(tmp_path, content, message):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(content))
    with pytest.raises(RunError, match=message):
        RunSummary.from_json(path)


def test_an_unreadable_summary_is_one_clear_error(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text('{"model": ')
    with pytest.raises(RunError, match=f"cannot read {path}"):
        RunSummary.from_json(path)
