"""The results a file holds, as `report` and `plan --calibrate` read them: a bench result file
(schema.py), or the estimates of a plan file (`neuron-train plan --output`, written by
cost/plan/result.py), each result checked against the one schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from neuron_train.common import reader
from neuron_train.common.errors import UsageError
from neuron_train.common.values import header_problem, shown
from neuron_train.cost.records import BenchResult
from neuron_train.cost.schema import MEASURED, RESULT_LIMIT

PLAN_SCHEMA = "neuron-train-plan"
PLAN_VERSION = 1


def plan_results(data: object, where: str) -> list[BenchResult]:
    """The bench results inside a plan file (each checked against the result schema)."""
    problem = header_problem(data, "schema", PLAN_SCHEMA, "schema_version", PLAN_VERSION)
    if problem:
        raise UsageError(f"{where}: not a plan file ({problem})")
    results = cast(dict, data).get("results")  # a JSON object: header_problem checked it
    if not isinstance(results, list) or not results:
        raise UsageError(f"{where}: a plan file without results: run neuron-train plan again")
    return [BenchResult.from_json(r, f"{where} results[{i}]") for i, r in enumerate(results)]


def load_results(path: str | Path) -> list[BenchResult]:
    """The results of one file: a bench result, or the estimates of a plan file (cost/plan/result.py)."""
    path = Path(path)
    data = reader.load(path, fmt="json", limit=RESULT_LIMIT)
    if isinstance(data, dict) and data.get("schema") == PLAN_SCHEMA:
        results = plan_results(data, str(path))
        for i, r in enumerate(results):  # each row's origin must be the file's kind
            if not r.estimated:
                raise UsageError(f"{path} results[{i}]: a plan file holds estimates only, this row says "
                                 f"source {shown(r.source or MEASURED)}: give measurements as bench "
                                 "result files")
        return results
    result = BenchResult.from_json(data, str(path))
    if result.estimated:
        raise UsageError(f"{path}: an estimate outside a plan file (source 'estimated'): give the plan "
                         "file that `neuron-train plan --output` wrote")
    return [result]
