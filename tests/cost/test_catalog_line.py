"""A new instance type of a known chip is one data line: added to a copy of instances.yaml (no code
edited), plan estimates it, report prices it and bench knows its NeuronCores and whether it trains."""

from __future__ import annotations

import csv
import json

import pytest

from neuron_train import cli
from neuron_train.common.errors import UsageError
from neuron_train.cost import catalog
from neuron_train.cost.bench.instance import check_mode_fits
from neuron_train.cost.bench.measure import neuron_cores
from neuron_train.cost.plan import data as plan_data

# a trn1 type between the 2xlarge and the 32xlarge (hypothetical: 8 Trainium chips, half a 32xlarge)
LINE = ('  trn1.16xlarge: {accelerator: Trainium, accelerators: 8, cores: 16, core_kind: NeuronCore-v2, '
        'accelerator_memory_gib: 256, vcpus: 64, host_memory_gib: 256, can_train: true, spec_source: '
        'neuron-trn1-arch, price: {usd_per_hour: 10.75, region: us-east-1, date: "2026-11-27", source: one line}}\n')
NEW = "trn1.16xlarge"


@pytest.fixture
def one_more_line(tmp_path, monkeypatch):
    """The shipped catalog with LINE added under `instances:`, as the file every command reads."""
    text = catalog.CATALOG_PATH.read_text()
    assert NEW not in text and text.count("\ninstances:\n") == 1
    copy = tmp_path / "instances.yaml"
    copy.write_text(text.replace("\ninstances:\n", "\ninstances:\n" + LINE))
    monkeypatch.setattr(catalog, "CATALOG_PATH", copy)
    return copy


def test_plan_estimates_the_new_type_from_its_chip(one_more_line, tmp_path, capsys, in_process_cli):
    target = plan_data.targets()[NEW]
    assert (target.chip.name, target.cores, target.vcpus, target.usd_per_hour) == ("Trainium", 16, 64, 10.75)
    assert NEW in [t.instance_type for t in plan_data.choose_targets(plan_data.targets(), None, "train")]
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--from-shapes", "--model", "vit-nano", "--batch-size", "8", "--instances",
                     f"{NEW},trn1.32xlarge", "--output", str(out)]) == 0
    assert any(line.startswith(f"{NEW} ") and " 16 " in line for line in capsys.readouterr().out.splitlines())
    [estimate] = [r for r in json.loads(out.read_text())["results"] if r["instance_type"] == NEW]
    assert estimate["world_size"] == 16

    # report: the plan's row of the new type, priced from the line
    assert cli.main(["report", str(out), "--out", str(tmp_path / "report")]) == 0
    with open(tmp_path / "report" / "report.csv", newline="") as f:
        [row] = [r for r in csv.DictReader(f) if r["instance_type"] == NEW]
    assert float(row["usd_per_hour"]) == 10.75


def test_bench_knows_the_new_types_cores_and_that_it_trains(one_more_line):
    assert neuron_cores(NEW) == 16
    check_mode_fits("train", NEW)  # no refusal: the line says it trains
    old = "can_train: true, spec_source: neuron-trn1-arch, price: {usd_per_hour: 10.75"
    new = "can_train: false, train_note: a test line, spec_source: neuron-trn1-arch, price: {usd_per_hour: 10.75"
    one_more_line.write_text(one_more_line.read_text().replace(old, new))
    with pytest.raises(UsageError, match=f"^{NEW} cannot train: a test line; use --mode infer$"):
        check_mode_fits("train", NEW)
