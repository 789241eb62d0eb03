"""The bench result as a typed record: written by `bench` (cost/bench/result.py) and, with `source:
estimated` and an `estimate` block, by `plan` (cost/plan/result.py); read by `report` and by
`plan --calibrate` (cost/results.py).

`BenchResult.from_json` is the one check of a result (schema.py's: every required field, every number
finite and in range, the cross-field rules), then the record; `to_json` writes the keys in the order
bench and plan write them, byte for byte (tests/graphs/test_records.py). Keys no field holds are not kept (a
result is read, never rewritten).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neuron_train.cost.schema import ESTIMATED, SCHEMA_NAME, SCHEMA_VERSION, validate_result


@dataclass(frozen=True)
class Stat:
    """A figure over the repeats: its median, the spread (half the range) and every value."""

    median: float
    spread: float
    values: list[float]

    @classmethod
    def from_json(cls, d: dict) -> Stat:
        return cls(d["median"], d["spread"], list(d["values"]))

    def to_json(self) -> dict[str, Any]:
        return {"median": self.median, "spread": self.spread, "values": list(self.values)}


@dataclass(frozen=True)
class Device:
    """What ran the measurement: the CPU XLA device, or NeuronCores (`count` of `cores_total`) and how
    the forward pass was compiled and called. None: not said."""

    kind: str
    count: int
    tracer: str | None = None
    compiler_args: str | None = None
    threads_per_core: int | None = None   # threads calling each core's copy (NeuronPerf's published rows: 2)
    cores_total: int | None = None
    host_threads: int | None = None       # inf1: host threads calling one data-parallel module
    harness: str | None = None            # a result written outside this package (scripts/inf1_bench.py)

    @classmethod
    def from_json(cls, d: dict) -> Device:
        return cls(d["kind"], d["count"], d.get("tracer"), d.get("compiler_args"), d.get("threads_per_core"),
                   d.get("cores_total"), d.get("host_threads"), d.get("harness"))

    def to_json(self) -> dict[str, Any]:
        told = {"tracer": self.tracer, "compiler_args": self.compiler_args, "threads_per_core": self.threads_per_core,
                "cores_total": self.cores_total, "host_threads": self.host_threads, "harness": self.harness}
        return {"kind": self.kind, "count": self.count, **{k: v for k, v in told.items() if v is not None}}


@dataclass(frozen=True)
class ModelFacts:
    name: str
    parameters: int | None    # None: not known (a script's, when no optimizer step was seen)
    img_size: int | None
    num_classes: int | None

    @classmethod
    def from_json(cls, d: dict) -> ModelFacts:
        return cls(d["name"], d["parameters"], d["img_size"], d["num_classes"])

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "parameters": self.parameters, "img_size": self.img_size,
                "num_classes": self.num_classes}


@dataclass(frozen=True)
class DatasetFacts:
    name: str
    train_samples: int | None  # None: not known (no cost per epoch)

    @classmethod
    def from_json(cls, d: dict) -> DatasetFacts:
        return cls(d["name"], d["train_samples"])

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "train_samples": self.train_samples}


@dataclass(frozen=True)
class CompileFacts:
    time_s: float
    graph_count: int

    @classmethod
    def from_json(cls, d: dict) -> CompileFacts:
        return cls(d["time_s"], d["graph_count"])

    def to_json(self) -> dict[str, Any]:
        return {"time_s": self.time_s, "graph_count": self.graph_count}


HOST_KEYS = ("hostname", "os", "cpu", "cpu_count", "memory_gib", "load_average_1m", "python")


@dataclass(frozen=True)
class Host:
    """The host a result was measured on; `told` names the facts the file gives (a fact may be given
    as null: not known there), in the order written."""

    told: tuple[str, ...] = ()
    hostname: object = None
    os: object = None
    cpu: str | None = None
    cpu_count: int | None = None
    memory_gib: object = None
    load_average_1m: float | None = None
    python: object = None

    @classmethod
    def from_json(cls, d: dict) -> Host:
        told = tuple(k for k in HOST_KEYS if k in d)
        return cls(told, d.get("hostname"), d.get("os"), d.get("cpu"), d.get("cpu_count"), d.get("memory_gib"),
                   d.get("load_average_1m"), d.get("python"))

    @property
    def cpu_shown(self) -> str:
        """The CPU as a report line names it: "?" when the file does not say."""
        return f"{self.cpu}" if "cpu" in self.told else "?"

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.told}


@dataclass(frozen=True)
class SweepRow:
    """One configuration a sweep tried: "ok" with its figures, or "oom" / "failed" with the reason."""

    batch_size_per_device: int
    world_size: int
    status: str
    reason: str
    samples_per_sec: float | None = None
    step_time_ms: float | None = None
    compile_time_s: float | None = None
    graph_count: int | None = None

    @classmethod
    def from_json(cls, d: dict) -> SweepRow:
        return cls(d["batch_size_per_device"], d["world_size"], d["status"], d["reason"], d.get("samples_per_sec"),
                   d.get("step_time_ms"), d.get("compile_time_s"), d.get("graph_count"))

    def to_json(self) -> dict[str, Any]:
        figures = {"samples_per_sec": self.samples_per_sec, "step_time_ms": self.step_time_ms,
                   "compile_time_s": self.compile_time_s, "graph_count": self.graph_count}
        return {"batch_size_per_device": self.batch_size_per_device, "world_size": self.world_size,
                "status": self.status, "reason": self.reason, **{k: v for k, v in figures.items() if v is not None}}


@dataclass(frozen=True)
class EstimateBlock:
    """How `plan` estimated a result: what bounds the step, its parts, the band of rates the
    calibration's error allows, its price-performance rank, the memory it needs, the calibration."""

    bottleneck: str | None
    bottleneck_text: str
    parts_ms: dict[str, float] | None
    band: tuple[float, float]     # low, high samples/s
    rank: int | None
    needs_gib_per_core: float | None
    calibration: str

    @classmethod
    def from_json(cls, d: dict) -> EstimateBlock:
        low, high = d["band"]
        return cls(d.get("bottleneck"), d["bottleneck_text"], d.get("parts_ms"), (low, high), d.get("rank"),
                   d.get("needs_gib_per_core"), d["calibration"])

    def to_json(self) -> dict[str, Any]:
        return {"bottleneck": self.bottleneck, "bottleneck_text": self.bottleneck_text, "parts_ms": self.parts_ms,
                "band": list(self.band), "rank": self.rank, "needs_gib_per_core": self.needs_gib_per_core,
                "calibration": self.calibration}


@dataclass(frozen=True)
class BenchResult:
    """One bench result file (or one estimate of a plan file). `source` None: not said (measured)."""

    created_at: str
    mode: str
    instance_type: str
    instance_type_source: str
    device: Device
    world_size: int
    model: ModelFacts
    dataset: DatasetFacts
    batch_size_per_device: int
    global_batch_size: int
    precision: str
    warmup_steps: int
    measured_steps: int
    repeats: int
    samples_per_sec: Stat
    step_time_ms: Stat
    compile: CompileFacts
    sweep: list[SweepRow] | None
    host: Host
    versions: dict[str, Any]
    command: str
    config: dict[str, Any]
    source: str | None = None
    estimate: EstimateBlock | None = None
    details: dict[str, Any] | None = None   # free-form figures of the run (bench writes them; plan does not)

    @property
    def estimated(self) -> bool:
        return self.source == ESTIMATED

    @classmethod
    def from_json(cls, data: object, where: str) -> BenchResult:
        """The result, checked (one line naming `where` and the first bad field: UsageError)."""
        d = validate_result(data, where)
        return cls(
            d["created_at"], d["mode"], d["instance_type"], d["instance_type_source"], Device.from_json(d["device"]),
            d["world_size"], ModelFacts.from_json(d["model"]), DatasetFacts.from_json(d["dataset"]),
            d["batch_size_per_device"], d["global_batch_size"], d["precision"], d["warmup_steps"],
            d["measured_steps"], d["repeats"], Stat.from_json(d["samples_per_sec"]), Stat.from_json(d["step_time_ms"]),
            CompileFacts.from_json(d["compile"]), [SweepRow.from_json(r) for r in d["sweep"]] if d["sweep"] is not None
            else None, Host.from_json(d["host"]), d["versions"], d["command"], d["config"], d.get("source"),
            EstimateBlock.from_json(d["estimate"]) if d.get("source") == ESTIMATED else None,
            d.get("details"))

    def to_json(self) -> dict[str, Any]:
        head: dict[str, Any] = {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION, "created_at": self.created_at}
        if self.source is not None:
            head["source"] = self.source
        body: dict[str, Any] = {
            "mode": self.mode, "instance_type": self.instance_type, "instance_type_source": self.instance_type_source,
            "device": self.device.to_json(), "world_size": self.world_size, "model": self.model.to_json(),
            "dataset": self.dataset.to_json(), "batch_size_per_device": self.batch_size_per_device,
            "global_batch_size": self.global_batch_size, "precision": self.precision,
            "warmup_steps": self.warmup_steps, "measured_steps": self.measured_steps, "repeats": self.repeats,
            "samples_per_sec": self.samples_per_sec.to_json(), "step_time_ms": self.step_time_ms.to_json(),
            "compile": self.compile.to_json()}
        if self.estimate is not None:
            body["estimate"] = self.estimate.to_json()
        if self.details is not None:
            body["details"] = self.details
        tail = {"sweep": None if self.sweep is None else [r.to_json() for r in self.sweep],
                "host": self.host.to_json(), "versions": self.versions, "command": self.command, "config": self.config}
        return {**head, **body, **tail}
