"""`report`'s rules on estimates and names (issue 31, reliability round 4), in-process: an estimate says
how it was estimated, a row's origin is its file's kind (a plan file holds estimates only), and names
from the inputs are text in report.md and report.csv. Each test was seen failing with its rule
removed (docs/reliability.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def plan_file(tmp_path: Path, *rows: dict) -> Path:
    from neuron_train.cost.results import PLAN_SCHEMA, PLAN_VERSION

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"schema": PLAN_SCHEMA, "schema_version": PLAN_VERSION, "results": list(rows)}))
    return path

def estimate(**block) -> dict:
    from tests.cost.test_report_reliability import INFER

    return {**INFER, "instance_type": "trn1.2xlarge", "source": "estimated",
            "estimate": {"bottleneck_text": "device compute", "calibration": "published", "band": [90.0, 110.0],
                         **block}}

def report_line(capsys, *argv) -> tuple[int, str]:
    from neuron_train import cli

    code = cli.main(["report", *map(str, argv)])
    err = capsys.readouterr().err
    assert err.count("\n") <= 1 and "Traceback" not in err, err
    return code, err

@pytest.mark.parametrize("row, message", [
    ({k: v for k, v in estimate().items() if k != "estimate"}, "missing field 'estimate'"),
    (estimate(band="90-110"), "field 'estimate.band'"),
    (estimate(band=[110.0, 90.0]), "low <= high"),
    (estimate(band=[float("nan"), 9.0]), "field 'estimate.band.0'"),
    (estimate(calibration=None), "field 'estimate.calibration'"),
    ({**estimate(), "source": "guessed"}, "field 'source' must be one of measured, estimated"),
])
def test_an_estimate_must_say_how_it_was_estimated(tmp_path, capsys, row, message):
    """Bad row 4: `report` trusted `"source": "estimated"` (KeyError, ValueError)."""
    code, err = report_line(capsys, plan_file(tmp_path, row), "--out", tmp_path / "rep")
    assert code == 2 and message in err
    assert not (tmp_path / "rep").exists()

def test_each_rows_origin_must_be_its_files_kind(tmp_path, capsys):
    """A plan file holds estimates only; an estimate comes only in a plan file."""
    from tests.cost.test_report_reliability import INFER

    measured = {**INFER, "instance_type": "trn1.2xlarge"}
    code, err = report_line(capsys, plan_file(tmp_path, estimate(), measured), "--out", tmp_path / "rep")
    assert code == 2 and "results[1]: a plan file holds estimates only" in err
    alone = tmp_path / "estimate.json"
    alone.write_text(json.dumps(estimate()))
    code, err = report_line(capsys, alone, "--out", tmp_path / "rep")
    assert code == 2 and "an estimate outside a plan file" in err
    code, err = report_line(capsys, plan_file(tmp_path, estimate()), "--out", tmp_path / "rep")
    assert code == 0 and "ESTIMATE" in (tmp_path / "rep" / "report.md").read_text()

def test_names_from_the_inputs_are_text_in_report_md_and_report_csv(tmp_path, capsys):
    """Weak row: report.md carried raw HTML from model names; report.csv cells starting with = were
    formulas in a spreadsheet."""
    from tests.cost.test_report_reliability import result

    name = "=HYPERLINK(\"x\")<img src=x onerror=alert(1)>"
    code, err = report_line(capsys, result(tmp_path, model__name=name), "--out", tmp_path / "rep")
    assert code == 0, err
    md, csv_text = ((tmp_path / "rep" / f).read_text() for f in ("report.md", "report.csv"))
    assert "<img" not in md and "&lt;img src=x onerror=alert(1)&gt;" in md
    cells = next(__import__("csv").reader([line for line in csv_text.splitlines() if "HYPERLINK" in line]))
    assert "'" + name in cells and name not in cells
