"""The bench result's typed record (cost/records.py): every result file the code wrote, the fixtures and
the shipped examples read into a `BenchResult` and written back byte for byte; bench and plan write
what the dict-based code wrote (`fixtures/cost/known_results.json`, written by the code of commit
34f9825, where sweep rows and results were dicts, from the fixed inputs below).
"""

from __future__ import annotations

import json
import types

import pytest

from neuron_train.common.errors import UsageError
from neuron_train.cost.bench import result as bench_result
from neuron_train.cost.bench.measure import Measurement, Workload
from neuron_train.cost.plan import data as plan_data
from neuron_train.cost.plan.model import estimate_all
from neuron_train.cost.plan.result import plan_document
from neuron_train.cost.records import BenchResult, SweepRow
from tests.conftest import ROOT
from tests.cost.test_plan import CALIB, workload

KNOWN = ROOT / "tests" / "fixtures" / "cost" / "known_results.json"
WRITTEN = [*sorted((ROOT / "tests" / "fixtures" / "report").glob("cpu_*.json")),
           *sorted((ROOT / "docs" / "example-report-inputs" / "results").glob("*.json"))]
HOST = {"hostname": "h", "os": "Linux", "cpu": "x86_64", "cpu_count": 2, "memory_gib": None,
        "load_average_1m": 1.5, "python": "3.10.12"}
NEURON = {"tracer": "torch-neuronx", "compiler_args": "--auto-cast none", "threads_per_core": 2, "cores_total": 2}
SWEEP = [SweepRow(16, 2, "ok", "", 800.5, 40.0, 95.0, 1),
         SweepRow(64, 2, "oom", "out of memory (larger batch sizes not tried)")]


def _dumped(data: object) -> str:
    return json.dumps(data, indent=2, default=str) + "\n"   # as common/fileio.write_json_atomic writes


def known_results(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """What bench and plan write from fixed inputs (the clock, the host and the versions fixed)."""
    fixed = types.SimpleNamespace(now=lambda tz: __import__("datetime").datetime(2026, 11, 27, tzinfo=tz),
                                  timezone=__import__("datetime").timezone)
    monkeypatch.setattr(bench_result, "dt", types.SimpleNamespace(datetime=fixed, timezone=fixed.timezone))
    monkeypatch.setattr(bench_result, "host_metadata", lambda: dict(HOST))
    monkeypatch.setattr(bench_result, "library_versions", lambda names: {"torch": "2.9.0", "torch-xla": "2.9.0"})
    work = Workload("vit_tiny", 5_700_000, 224, 1000, "synthetic", 1_281_167, 32, "bf16", {"model": {"name": "v"}})
    neuron = [Measurement(812.5, 39.4, 95.2, 1, 20, 2, 64, "NEURON", dict(NEURON)),
              Measurement(790.0, 40.5, 0.0, 0, 20, 2, 64, "NEURON", dict(NEURON))]
    cpu = [Measurement(120.0, 266.0, 30.5, 3, 20, 1, 32, "CPU", {}, {"final_loss": 2.25})]
    out = {}
    for name, runs, sweep in (("bench_neuron_infer", neuron, SWEEP), ("bench_cpu_train", cpu, None)):
        result = bench_result.build_result(workload=work, mode="infer" if runs is neuron else "train",
                                           instance=("inf2.xlarge", "flag"), runs=runs, sweep_rows=sweep,
                                           warmup=3, command="neuron-train bench ...")
        out[name] = _dumped(result.to_json())
    targets = plan_data.targets()
    chosen = [targets[n] for n in ("trn1.2xlarge", "inf2.xlarge")]
    w = workload()
    doc = plan_document(w, estimate_all(w, chosen, CALIB, None, 1000), CALIB, details={"parameters": 5_700_000},
                        img_size=224, dataset="synthetic", epoch_samples=1000, precision="bf16",
                        command="neuron-train plan ...", first_off=None)
    for i, r in enumerate(doc["results"]):
        r = {**r, "created_at": "2026-11-27T00:00:00+00:00"}
        out[f"plan_estimate_{i}"] = _dumped(r)
    return out


def _keys(data: object, at: str = "") -> list[str]:
    """Every key path in the order written (a plan's workload record apart: the plan model's own)."""
    if isinstance(data, list):
        return [k for i, v in enumerate(data) for k in _keys(v, f"{at}[{i}]")]
    if not isinstance(data, dict) or at == "config":
        return []
    return [k for key, v in data.items() for k in [f"{at}.{key}".lstrip("."), *_keys(v, f"{at}.{key}".lstrip("."))]]


def test_bench_and_plan_write_what_the_dict_based_code_wrote(monkeypatch):
    """bench's files byte for byte; plan's estimates key for key, in order (their figures are the plan
    model's, which may change)."""
    written, known = known_results(monkeypatch), json.loads(KNOWN.read_text())
    assert written.keys() == known.keys()
    for name in ("bench_neuron_infer", "bench_cpu_train"):
        assert written[name] == known[name], name
    for name in ("plan_estimate_0", "plan_estimate_1"):
        assert _keys(json.loads(written[name])) == _keys(json.loads(known[name])), name


@pytest.mark.parametrize("path", WRITTEN, ids=lambda p: p.name)
def test_a_written_result_file_reads_into_the_record_and_back_byte_for_byte(path):
    text = path.read_text()
    assert _dumped(BenchResult.from_json(json.loads(text), str(path)).to_json()) == text


def test_every_known_result_reads_into_the_record_and_back_byte_for_byte():
    known = json.loads(KNOWN.read_text())
    assert len(known) == 4   # a Neuron inference with its sweep, a CPU training run, two estimates
    for name, text in known.items():
        record = BenchResult.from_json(json.loads(text), name)
        assert _dumped(record.to_json()) == text, name
    neuron = BenchResult.from_json(json.loads(known["bench_neuron_infer"]), "neuron")
    assert neuron.device.threads_per_core == 2 and neuron.host.memory_gib is None and not neuron.estimated
    assert neuron.sweep is not None and neuron.sweep[1].samples_per_sec is None and neuron.sweep[1].status == "oom"
    estimate = BenchResult.from_json(json.loads(known["plan_estimate_0"]), "plan")
    assert estimate.estimated and estimate.estimate is not None and estimate.estimate.band[0] > 0


def test_the_record_refuses_what_the_schema_refuses():
    data = json.loads(WRITTEN[0].read_text())
    data["repeats"] = 0
    with pytest.raises(UsageError, match=r"^x: field 'repeats' must be an integer >= 1, got 0$"):
        BenchResult.from_json(data, "x")


if __name__ == "__main__":  # writes the fixture from this tree (run once on the dict-based code)
    KNOWN.parent.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        KNOWN.write_text(json.dumps(known_results(mp), indent=1) + "\n")
