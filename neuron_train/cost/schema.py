"""The bench result file: one versioned JSON schema, written by `bench` and read by `report`.

Every field is required (null only where its kind allows it) and every number is checked (type,
finite, range) before the report draws anything; `validate_result` is the one check both sides
use, so a file `report` would refuse is never written.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, ValidationError

from neuron_train.common.errors import UsageError
from neuron_train.common.values import header_problem, kind_problem, shown

SCHEMA_NAME = "neuron-train-bench-result"
SCHEMA_VERSION = 1
MODES = ("train", "infer")
# Where a result's numbers come from (its optional `source`; absent: measured). An estimate is
# written only inside a plan file (cost/plan/result.py) and always carries an `estimate` block.
MEASURED, ESTIMATED = "measured", "estimated"
ORIGINS = (MEASURED, ESTIMATED)
RESULT_LIMIT = 16 * 2**20  # a bench result or plan file is a few KiB; a long sweep a few hundred
# dotted path -> kind (neuron_train.common.values). Every field is required; numbers are finite.
RESULT_FIELDS: dict[str, str] = {
    "schema": "str", "schema_version": "int>=1", "created_at": "str", "mode": "str",
    "instance_type": "str", "instance_type_source": "str",
    "device.kind": "str", "device.count": "int>=1",
    "world_size": "int>=1",
    # null: not known (a script measured by `bench -- COMMAND` says only what it can see)
    "model.name": "str", "model.parameters": "int>=1?", "model.img_size": "int>=1?", "model.num_classes": "int>=1?",
    "dataset.name": "str", "dataset.train_samples": "int>=1?",
    "batch_size_per_device": "int>=1", "global_batch_size": "int>=1", "precision": "str",
    "warmup_steps": "int>=0", "measured_steps": "int>=1", "repeats": "int>=1",
    "samples_per_sec.median": "number>0", "samples_per_sec.spread": "number>=0",
    "samples_per_sec.values": "number-list>0",
    "step_time_ms.median": "number>0", "step_time_ms.spread": "number>=0", "step_time_ms.values": "number-list>0",
    "compile.time_s": "number>=0", "compile.graph_count": "int>=0",
    "sweep": "list?", "host": "object", "versions": "object", "command": "str", "config": "object",
}
# Optional fields the report reads: checked when present.
OPTIONAL_FIELDS: dict[str, str] = {
    "host.cpu": "str?", "host.cpu_count": "int>=1?", "host.load_average_1m": "number>=0?",
    # infer on Neuron: what compiled the forward pass and how, and the NeuronCores of the instance
    # (device.count of device.cores_total ran it; fewer than all is said on the report's row)
    "device.tracer": "str?", "device.compiler_args": "str?", "device.cores_total": "int>=1?",
    # infer on Neuron: threads calling each core's copy (NeuronPerf's published rows: 2)
    "device.threads_per_core": "int>=1?",
    # infer through one data-parallel module (inf1): host threads calling it at once (published inf1 rows: 4)
    "device.host_threads": "int>=1?",
    # a result written outside this package (scripts/inf1_bench.py in the inf1 environment)
    "device.harness": "str?",
}
SWEEP_STATUSES = ("ok", "oom", "failed")
# A sweep row: every row has the first four; a row with status "ok" has all of them.
SWEEP_FIELDS: dict[str, str] = {
    "batch_size_per_device": "int>=1", "world_size": "int>=1", "status": "str", "reason": "str",
    "samples_per_sec": "number>0", "step_time_ms": "number>0", "compile_time_s": "number>=0", "graph_count": "int>=0",
}
# No machine measures a billion samples/s or a step of 11 days: larger numbers are not measurements.
MAX_PLAUSIBLE = 1e9
_SWEEP_ALWAYS = ("batch_size_per_device", "world_size", "status", "reason")
_MISSING = object()


def _lookup(data: dict, dotted: str) -> object:
    node = data
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def validate_result(data: object, where: str) -> dict:
    """Check a parsed result file against the schema; raise UsageError naming the file and the
    first bad field (every number of it: type, finite, range)."""
    problem = header_problem(data, "schema", SCHEMA_NAME, "schema_version", SCHEMA_VERSION)
    if problem or not isinstance(data, dict):  # (header_problem names a non-object too)
        raise UsageError(f"{where}: not a bench result ({problem})")
    for dotted, kind in {**RESULT_FIELDS, **OPTIONAL_FIELDS}.items():
        value = _lookup(data, dotted)
        if value is _MISSING and dotted in RESULT_FIELDS:
            raise UsageError(f"{where}: missing field '{dotted}'")
        problem = None if value is _MISSING else kind_problem(value, kind)
        if problem:
            raise UsageError(f"{where}: field '{dotted}' {problem}")
    problems = _semantic_problems(data) + _sweep_problems(data["sweep"] or []) + _origin_problems(data)
    if problems:
        raise UsageError(f"{where}: {problems[0]}")
    return data


class EstimateBlock(BaseModel):
    """What `report` reads of an estimate's `estimate` block (cost/plan/result.py writes it)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    bottleneck_text: str
    calibration: str
    band: list[PositiveFloat] = Field(min_length=2, max_length=2)  # low, high samples/s


def _origin_problems(d: dict) -> list[str]:
    """`source` says where the numbers come from; an estimate must carry the block that says how."""
    source = d.get("source", MEASURED)
    if source not in ORIGINS:
        return [f"field 'source' must be one of {', '.join(ORIGINS)}, got {shown(source)}"]
    if source != ESTIMATED:
        return []
    if "estimate" not in d:
        return ["missing field 'estimate' (every estimated result says how it was estimated)"]
    try:
        block = EstimateBlock.model_validate(d["estimate"])
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in ("estimate", *first["loc"]))
        return [f"field '{field}' {first['msg'].lower()}, got {shown(first['input'])}"]
    low, high = block.band
    if not low <= high or high > MAX_PLAUSIBLE:
        return [f"field 'estimate.band' must be a range low <= high <= {MAX_PLAUSIBLE:.0e}, got {list(block.band)}"]
    return []


def _semantic_problems(d: dict) -> list[str]:
    p = []
    if d["mode"] not in MODES:
        p.append(f"mode must be one of {', '.join(MODES)}, got {d['mode']!r}")
    if d["global_batch_size"] % (d["batch_size_per_device"] * d["world_size"]) != 0:
        p.append(f"global_batch_size {d['global_batch_size']} is not a multiple of batch_size_per_device "
                 f"x world_size ({d['batch_size_per_device']} x {d['world_size']})")
    total = d["device"].get("cores_total")
    if isinstance(total, int) and total < d["device"]["count"]:
        p.append(f"device.count {d['device']['count']} is more than device.cores_total {total}")
    for field, unit in (("samples_per_sec", "samples/s"), ("step_time_ms", "ms")):
        largest = max([d[field]["median"], *d[field]["values"]])
        if largest > MAX_PLAUSIBLE:  # finite but absurd: it would overflow the cost arithmetic
            p.append(f"field '{field}' has {largest:.3g} {unit}, more than {MAX_PLAUSIBLE:.0e}: not a "
                     "measurement (was the file edited?)")
    if len(d["samples_per_sec"]["values"]) != d["repeats"]:
        p.append(f"samples_per_sec.values has {len(d['samples_per_sec']['values'])} entries for "
                 f"{d['repeats']} repeats")
    return p


def _sweep_problems(rows: list) -> list[str]:
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            return [f"field 'sweep[{i}]' must be a JSON object"]
        if row.get("status") not in SWEEP_STATUSES:
            return [f"field 'sweep[{i}].status' must be one of {', '.join(SWEEP_STATUSES)}, got {row.get('status')!r}"]
        for key, kind in SWEEP_FIELDS.items():
            if key not in row:
                if key in _SWEEP_ALWAYS or row["status"] == "ok":
                    return [f"missing field 'sweep[{i}].{key}'"]
                continue
            problem = kind_problem(row[key], kind)
            if not problem and kind.startswith("number") and row[key] > MAX_PLAUSIBLE:
                problem = f"must be at most {MAX_PLAUSIBLE:.0e} (not a measurement), got {row[key]:.3g}"
            if problem:
                return [f"field 'sweep[{i}].{key}' {problem}"]
    return []
