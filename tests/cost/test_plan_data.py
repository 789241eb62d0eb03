"""plan's data files (cost/plan/data.py) read as the other files cost reads: through the reader, each
field checked, into records (PublishedRow, Architecture, Chip); a bad field is one line naming the
file and the field, never a traceback or a silently ignored key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from neuron_train.common.errors import UsageError
from neuron_train.cost.catalog import CATALOG_PATH
from neuron_train.cost.plan import data as plan_data

PUBLISHED = yaml.safe_load(plan_data.PUBLISHED_PATH.read_text())
CATALOG = yaml.safe_load(CATALOG_PATH.read_text())


def _published(tmp_path: Path, change) -> Path:
    data = copy.deepcopy(PUBLISHED)
    change(data)
    path = tmp_path / "published.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _first_row(data: dict) -> dict:
    return data["rows"][0]


@pytest.mark.parametrize("change, line", [
    (lambda d: _first_row(d).update(worker=2), r"rows\[0\]: unknown field 'worker' \(known: model, arch, "),
    (lambda d: _first_row(d).update(samples_per_sec="fast"),
     r"rows\[0\]: field 'samples_per_sec' must be a finite number > 0, got 'fast'$"),
    (lambda d: _first_row(d).pop("sdk"), r"rows\[0\]: missing field 'sdk'$"),
    (lambda d: _first_row(d).update(arch="no-such-arch"), r"names the architecture 'no-such-arch', which "),
    (lambda d: next(iter(d["architectures"].values())).pop("params_m"),
     r"architectures\.\S+: missing field 'params_m'$"),
    (lambda d: next(iter(d["architectures"].values())).update(gated_ffn="yes"),
     r"field 'gated_ffn' must be true or false, got 'yes'$"),
    (lambda d: d.update(rows={"a": 1}), r"field 'rows' must be a list, got \{'a': 1\}$"),
])
def test_a_bad_published_row_or_architecture_is_one_line_naming_the_field(tmp_path, change, line):
    path = _published(tmp_path, change)
    with pytest.raises(UsageError, match=line) as exc:
        plan_data.load_published(path)
    assert str(exc.value).startswith(str(path)) and len(str(exc.value).splitlines()) == 1


def test_the_shipped_rows_and_architectures_read_whole():
    rows, archs = plan_data.load_published()
    assert len(rows) == len(PUBLISHED["rows"]) and archs.keys() == PUBLISHED["architectures"].keys()
    vit = next(a for a in archs.values() if a.tokens)   # a transformer whose rows do not give the sequence
    assert vit.hidden > 0 and vit.layers > 0


@pytest.mark.parametrize("field, value, line", [
    ("cores_per_chip", 0, r"plan_hardware\.Trainium: field 'cores_per_chip' must be an integer >= 1, got 0$"),
    ("link_gb_per_s", None, r"plan_hardware\.Trainium: field 'link_gb_per_s' must be a finite number > 0, got null$"),
    ("peak_tflops_per_chip", {"bf16": "many"},
     r"field 'peak_tflops_per_chip\.bf16' must be a finite number >= 0, got 'many'$"),
    ("host_costs", {"copy_gb_per_s": 8},
     r"plan_hardware\.Trainium\.host_costs: unknown field 'copy_gb_per_s' \(known: "),
    ("host_costs", {"copy_bytes_per_s": 0},
     r"host_costs: field 'copy_bytes_per_s' must be a finite number > 0, got 0$"),
    ("host_costs", {"dispatch_s": -1e-4},
     r"host_costs: field 'dispatch_s' must be a finite number >= 0, got -0\.0001$"),
    ("host_costs", [1], r"plan_hardware\.Trainium\.host_costs must be a mapping of fields, got \[1\]$"),
])
def test_a_bad_chip_is_one_line_naming_the_field(tmp_path, field, value, line):
    data = copy.deepcopy(CATALOG)
    data["plan_hardware"]["Trainium"][field] = value
    path = tmp_path / "instances.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(UsageError, match=line):
        plan_data.load_chips(path)


def _chips_with(tmp_path: Path, chip: str, host_costs: dict) -> Path:
    data = copy.deepcopy(CATALOG)
    data["plan_hardware"][chip]["host_costs"] = host_costs
    path = tmp_path / "instances.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_chips_host_costs_are_one_data_line_and_move_only_that_chips_estimates(tmp_path):
    """The host costs are per chip (`plan_hardware.<chip>.host_costs`): a line there changes the estimates
    of that chip's instances and no other's; the fields it does not name keep their defaults, and the
    calibration's fitted tracing and image costs still lay over it."""
    from neuron_train.cost.plan.calibrate import published_calibration
    from neuron_train.cost.plan.model import HostCosts, estimate
    from tests.cost.test_plan import workload

    shipped = plan_data.targets()
    chips = plan_data.load_chips(_chips_with(tmp_path, "Inferentia2", {"copy_bytes_per_s": 8e9, "dispatch_s": 0.0}))
    assert chips["Inferentia2"].host == HostCosts(copy_bytes_per_s=8e9, dispatch_s=0.0)
    assert chips["Trainium"].host == HostCosts()
    changed = plan_data.targets(chips=chips)
    calib = published_calibration()
    w = workload(input_bytes=8e8)                    # a 0.2 s copy at 4 GB/s, 0.1 s at 8 GB/s
    before, after = estimate(w, shipped["inf2.xlarge"], calib), estimate(w, changed["inf2.xlarge"], calib)
    assert after.parts_s["compute"] == pytest.approx(before.parts_s["compute"] - 0.1)
    assert after.parts_s["host_rest"] == pytest.approx(before.parts_s["host_rest"] - 1e-4)  # its dispatch gone
    assert estimate(w, changed["trn1.2xlarge"], calib) == estimate(w, shipped["trn1.2xlarge"], calib)
    assert calib.host is not None and calib.host_on(chips["Inferentia2"]).trace_s_per_instruction == \
        calib.host.trace_s_per_instruction
