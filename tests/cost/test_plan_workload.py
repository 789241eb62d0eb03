"""plan's workload as a record (cost/plan/model.WorkloadFigures): what plan wrote reads back through
`from_json` (each field checked, one line naming the file and the field) and writes out byte for byte
with `to_json`, as plan.json holds it."""

from __future__ import annotations

import json

import pytest

from neuron_train.common.errors import UsageError
from neuron_train.cost.plan.model import WorkloadFigures
from tests.conftest import ROOT
from tests.cost.test_plan import workload
from tests.cost.test_plan_known import KNOWN

STANDINS = ROOT / "scripts" / "plan_standins.json"


def _written() -> list[dict]:
    """Every workload block plan wrote into the known plan files: the document's and each estimate's."""
    docs = json.loads(KNOWN.read_text()).values()
    return [b for d in docs for b in (d["workload"], *(r["config"]["workload"] for r in d["results"]))]


def test_a_written_workload_reads_into_the_record_and_back_byte_for_byte():
    blocks = _written()
    assert len(blocks) > 2 and any(b["host_input_s"] == "unknown" for b in blocks)
    for block in blocks:
        w = WorkloadFigures.from_json(block, "plan.json workload")
        assert json.dumps(w.to_json(), indent=2) == json.dumps(block, indent=2)


def test_a_kept_standin_workload_written_before_three_fields_existed_reads_with_their_defaults():
    for key, facts in json.loads(STANDINS.read_text()).items():
        w = WorkloadFigures.from_json(facts["workload"], key)
        assert w == WorkloadFigures(**{k: None if v == "unknown" else v for k, v in facts["workload"].items()})


@pytest.mark.parametrize("change, line", [
    ({"mode": "fit"}, r"^w: field 'mode' must be one of train, infer, got 'fit'$"),
    ({"execution": "eager"}, r"^w: field 'execution' must be one of lazy, compiled, replay, got 'eager'$"),
    ({"samples_per_step": 0}, r"^w: field 'samples_per_step' must be a finite number > 0, got 0$"),
    ({"host_input_s": "soon"}, r"^w: field 'host_input_s' must be a finite number >= 0 or null, got 'soon'$"),
    ({"hlo_instructions": 1.5}, r"^w: field 'hlo_instructions' must be an integer >= 0, got 1\.5$"),
    ({"flops": 1e9}, r"^w: unknown field 'flops' \(known: name, mode, "),
    ({"flops_per_step": None}, r"^w: field 'flops_per_step' must be a finite number >= 0, got null$"),
])
def test_a_bad_workload_field_is_one_line_naming_it(change, line):
    with pytest.raises(UsageError, match=line):
        WorkloadFigures.from_json({**workload().to_json(), **change}, "w")


def test_a_missing_figure_without_a_default_is_refused():
    block = workload().to_json()
    del block["grad_bytes"]
    with pytest.raises(UsageError, match=r"^w: missing field 'grad_bytes'$"):
        WorkloadFigures.from_json(block, "w")
    with pytest.raises(UsageError, match=r"^w must be a mapping of fields, got \[1\]$"):
        WorkloadFigures.from_json([1], "w")
