"""The bench result file: one versioned JSON schema, written by `bench` and read by `report`.

Every field is required (null only where it says so) and every number is checked (type, finite,
range) before the report draws anything; `validate_result` is the one check both sides use (through
the record, cost/records.py's `BenchResult.from_json`), so a file `report` would refuse is never
written.
"""

from __future__ import annotations

from collections.abc import Iterable

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
SWEEP_STATUSES = ("ok", "oom", "failed")
# No machine measures a billion samples/s or a step of 11 days: larger numbers are not measurements.
MAX_PLAUSIBLE = 1e9
_MISSING = object()


class Fields:
    """Checks a parsed file's fields by dotted path (common/values.py's kinds and their messages): the
    first problem is a UsageError naming the file and the field. The one check of the JSON and YAML
    files cost reads (a bench result here; plan/data.py's published rows, architectures and chips)."""

    def __init__(self, data: dict, where: str, prefix: str = "") -> None:
        self.data, self.where, self.prefix = data, where, prefix

    @classmethod
    def of(cls, data: object, where: str) -> Fields:
        """The fields of `data`, which must be a mapping."""
        if not isinstance(data, dict):
            raise UsageError(f"{where} must be a mapping of fields, got {shown(data)}")
        return cls(data, where)

    def only(self, names: Iterable[str]) -> None:
        """No field but `names` (a misspelt optional field would be ignored silently)."""
        names = tuple(names)
        unknown = sorted(set(self.data) - set(names), key=str)
        if unknown:
            raise UsageError(f"{self.where}: unknown field {shown(unknown[0])} (known: {', '.join(names)})")

    def check(self, dotted: str, kind: str, *, required: bool = True, null: bool = False,
              most: float | None = None) -> None:
        """`kind` (common/values.py); `most`: a number's largest plausible value."""
        node: object = self.data
        for key in dotted.split("."):
            node = node.get(key, _MISSING) if isinstance(node, dict) else _MISSING
        if node is _MISSING:
            if required:
                raise UsageError(f"{self.where}: missing field '{self.prefix}{dotted}'")
            return
        problem = kind_problem(node, kind + ("?" if null else ""))
        if not problem and most is not None and node > most:  # type: ignore[operator]
            problem = f"must be at most {most:.0e} (not a measurement), got {node:.3g}"
        if problem:
            raise UsageError(f"{self.where}: field '{self.prefix}{dotted}' {problem}")

    def text(self, *dotted: str, required: bool = True, null: bool = False) -> None:
        for d in dotted:
            self.check(d, "str", required=required, null=null)

    def count(self, *dotted: str, least: int = 1, required: bool = True, null: bool = False) -> None:
        for d in dotted:
            self.check(d, f"int>={least}", required=required, null=null)

    def stat(self, name: str) -> None:
        """A figure over the repeats: median > 0, spread >= 0, every value > 0."""
        self.check(f"{name}.median", "number>0")
        self.check(f"{name}.spread", "number>=0")
        self.check(f"{name}.values", "number-list>0")


def validate_result(data: object, where: str) -> dict:
    """Check a parsed result file against the schema; raise UsageError naming the file and the
    first bad field (every number of it: type, finite, range). The fields in the order they are
    checked: every one is required (null where it says so), numbers are finite."""
    problem = header_problem(data, "schema", SCHEMA_NAME, "schema_version", SCHEMA_VERSION)
    if problem or not isinstance(data, dict):  # (header_problem names a non-object too)
        raise UsageError(f"{where}: not a bench result ({problem})")
    f = Fields(data, where)
    f.text("schema")
    f.count("schema_version")
    f.text("created_at", "mode", "instance_type", "instance_type_source", "device.kind")
    f.count("device.count", "world_size")
    f.text("model.name")
    # null: not known (a script measured by `bench -- COMMAND` says only what it can see)
    f.count("model.parameters", "model.img_size", "model.num_classes", null=True)
    f.text("dataset.name")
    f.count("dataset.train_samples", null=True)
    f.count("batch_size_per_device", "global_batch_size")
    f.text("precision")
    f.count("warmup_steps", least=0)
    f.count("measured_steps", "repeats")
    f.stat("samples_per_sec")
    f.stat("step_time_ms")
    f.check("compile.time_s", "number>=0")
    f.count("compile.graph_count", least=0)
    f.check("sweep", "list", null=True)
    f.check("host", "object")
    f.check("versions", "object")
    f.text("command")
    f.check("config", "object")
    _check_optional(f)
    problems = _semantic_problems(data)
    if problems:
        raise UsageError(f"{where}: {problems[0]}")
    _check_sweep(data["sweep"] or [], where)
    problems = _origin_problems(data)
    if problems:
        raise UsageError(f"{where}: {problems[0]}")
    return data


def _check_optional(f: Fields) -> None:
    """Fields the report reads when present."""
    f.text("host.cpu", required=False, null=True)
    f.count("host.cpu_count", required=False, null=True)
    f.check("host.load_average_1m", "number>=0", required=False, null=True)
    # infer on Neuron: what compiled the forward pass and how, and the NeuronCores of the instance
    # (device.count of device.cores_total ran it; fewer than all is said on the report's row)
    f.text("device.tracer", "device.compiler_args", required=False, null=True)
    f.count("device.cores_total", required=False, null=True)
    # infer on Neuron: threads calling each core's copy (NeuronPerf's published rows: 2); through one
    # data-parallel module (inf1): host threads calling it at once (published inf1 rows: 4)
    f.count("device.threads_per_core", "device.host_threads", required=False, null=True)
    # a result written outside this package (scripts/inf1_bench.py in the inf1 environment)
    f.text("device.harness", required=False, null=True)


class _EstimateCheck(BaseModel):
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
        block = _EstimateCheck.model_validate(d["estimate"])
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


def _check_sweep(rows: list, where: str) -> None:
    """Every row has its configuration, status and reason; a row with status "ok" has its figures."""
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise UsageError(f"{where}: field 'sweep[{i}]' must be a JSON object")
        if row.get("status") not in SWEEP_STATUSES:
            raise UsageError(f"{where}: field 'sweep[{i}].status' must be one of {', '.join(SWEEP_STATUSES)}, "
                             f"got {row.get('status')!r}")
        f = Fields(row, where, f"sweep[{i}].")
        f.count("batch_size_per_device", "world_size")
        f.text("status", "reason")
        ok = row["status"] == "ok"
        for name in ("samples_per_sec", "step_time_ms"):
            f.check(name, "number>0", required=ok, most=MAX_PLAUSIBLE)
        f.check("compile_time_s", "number>=0", required=ok, most=MAX_PLAUSIBLE)
        f.count("graph_count", least=0, required=ok)
