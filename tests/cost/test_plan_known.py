"""plan.json byte for byte: what plan writes from fixed inputs (two workloads, one with an input pipeline
the run did not tell, over every instance type, with the shipped calibration and host costs) is what the
code of commit 46d6d75 wrote (`fixtures/cost/known_plan.json`, written by `python -m
tests.cost.test_plan_known --write` there, before the workload became a record and the host costs a
field of the chip). A change to plan's figures fails here; re-write the fixture only for a change of the
model that is meant, and say so."""

from __future__ import annotations

import datetime
import json
import sys
import types

from neuron_train.cost.plan import calibrate as plan_calibrate
from neuron_train.cost.plan import data as plan_data
from neuron_train.cost.plan import result as plan_result
from neuron_train.cost.plan.model import estimate_all
from tests.conftest import ROOT
from tests.cost.test_plan import workload

KNOWN = ROOT / "tests" / "fixtures" / "cost" / "known_plan.json"
FIXED = datetime.datetime(2026, 11, 27, tzinfo=datetime.timezone.utc)


def known_plans() -> str:
    """The plan documents of two fixed workloads, as `plan --output` writes each (the clock fixed)."""
    clock = types.SimpleNamespace(now=lambda tz: FIXED)
    saved, plan_result.dt = plan_result.dt, types.SimpleNamespace(datetime=clock, timezone=datetime.timezone)
    try:
        calib = plan_calibrate.published_calibration()
        targets = plan_data.targets()
        docs = {}
        for name, w, mode in (
                ("train_lazy", workload(decoded_images=16.0, input_bytes=16 * 602112.0, loader_workers=0), "train"),
                ("infer_command", workload(name="s", mode="infer", execution="compiled", host_input_s=None,
                                           grad_bytes=0.0, optimizer_bytes=0.0, activation_bytes=0.0,
                                           output_bytes=4e6, measured_by="counted"), "infer")):
            chosen = plan_data.choose_targets(targets, None, mode)
            docs[name] = plan_result.plan_document(
                w, estimate_all(w, chosen, calib, None, 1000), calib, details={"parameters": 5_700_000},
                img_size=224, dataset="synthetic", epoch_samples=1000, precision="bf16",
                command="neuron-train plan ...", first_off=None)
    finally:
        plan_result.dt = saved
    return json.dumps(docs, indent=2, default=str) + "\n"   # as common/fileio.write_json_atomic writes


def test_plan_writes_what_it_wrote_before_byte_for_byte():
    assert known_plans() == KNOWN.read_text()


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    KNOWN.write_text(known_plans())
