"""The report's typed rows: one instance type's figure (measured, estimated, imported or
unsupported), built from a bench result, a plan's estimate, a published reference row or the
catalog, and a group of rows for one workload. Shared by the report's tables and its charts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from neuron_train.cost.catalog import Catalog, Price
from neuron_train.cost.records import BenchResult, Device, EstimateBlock
from neuron_train.cost.report.references import ReferenceRow
from neuron_train.cost.schema import ESTIMATED

MODE_TITLES = {"train": "Training", "infer": "Inference"}


@dataclass
class Row:
    instance_type: str
    mode: str
    model: str
    img_size: int | None
    origin: str                  # measured | imported | estimated | unsupported
    device: str                  # what ran it, e.g. "CPU (XLA device, not Neuron)"
    provenance: str              # where the figure comes from, readable by a person
    precision: str = ""
    framework: str = ""          # imported rows: the framework the table names
    batch_size: int | None = None
    world_size: int | None = None
    nodes: int = 1
    samples_per_sec: float | None = None
    spread: float | None = None
    unit: str = "samples"
    compile_time_s: float | None = None
    graph_count: int | None = None
    epoch_samples: int | None = None
    note: str = ""
    # derived by `price_rows`
    price: Price | None = None
    usd_per_hour: float | None = None
    samples_per_dollar: float | None = None
    usd_per_million: float | None = None
    usd_per_epoch: float | None = None
    relative: float | None = None
    is_baseline: bool = False

    @property
    def workload(self) -> tuple[str, str]:
        return self.mode, re.sub(r"[^a-z0-9]", "", self.model.lower())

    @property
    def config_text(self) -> str:
        if self.origin == "unsupported":
            return ""
        parts = [f"{self.img_size} px"] if self.img_size else []
        if self.batch_size:
            parts.append(f"batch {self.batch_size}" + (f" x {self.world_size}" if self.world_size else ""))
        if self.nodes > 1:
            parts.append(f"{self.nodes} instances")
        parts += [p for p in (self.precision, self.framework) if p]
        return ", ".join(parts)


class Priced(NamedTuple):
    """A row with a price-performance figure, and its figures as numbers."""

    row: Row
    per_dollar: float       # samples per dollar
    per_hour: float         # USD per hour, all instances


def priced_rows(rows: Iterable[Row]) -> list[Priced]:
    """The rows with samples per dollar (price_rows sets it together with a non-zero USD per hour)."""
    return [Priced(r, r.samples_per_dollar, r.usd_per_hour) for r in rows
            if r.samples_per_dollar and r.usd_per_hour]


@dataclass
class Group:
    mode: str
    model: str                   # as the first row names it
    rows: list[Row] = field(default_factory=list)
    baseline: Row | None = None
    baseline_note: str = ""
    epoch_samples: int | None = None

    @property
    def title(self) -> str:
        sizes = {r.img_size for r in self.rows if r.origin != "unsupported"}
        size = f" · {sizes.pop()} px" if len(sizes) == 1 and None not in sizes else ""
        return f"{MODE_TITLES[self.mode]} · {self.model}{size}"

    @property
    def unit(self) -> str:
        units = {r.unit for r in self.rows if r.samples_per_sec}
        return units.pop() if len(units) == 1 else "samples"


def device_text(device: Device) -> str:
    """What ran a measured row, as the report names it: the CPU labelled as not Neuron, and on Neuron
    how many of the instance's NeuronCores ran it (published figures use all of them)."""
    if device.kind == "CPU":
        return "CPU (XLA device, not Neuron)"
    parts = [device.kind]
    if device.tracer:
        parts.append(device.tracer)
    if device.cores_total:
        parts.append(f"{device.count} of {device.cores_total} NeuronCores")
    elif device.kind == "NEURON":
        parts.append(f"{device.count} NeuronCore(s), instance total not known")
    if device.threads_per_core:  # published rows: NeuronPerf's 2 threads per core (inf1 ResNet-50: 4)
        parts.append(f"{device.threads_per_core} thread(s) per core")
    if device.host_threads:  # one data-parallel module over every core (inf1), called by N threads
        parts.append(f"{device.host_threads} host thread(s)")
    return ", ".join(parts)


# What each compiler setting does to an fp32 model, so a row can be compared with published "FP32"
# rows, whose matmuls the compiler auto-cast to bf16 (inf2/trn1 tables: "Compilation Autocast").
_CAST_MEANING = {"--auto-cast none": "no auto-cast",
                 "--auto-cast matmult --auto-cast-type bf16": "matmuls auto-cast to bf16, as the published FP32 rows",
                 "--auto-cast all --auto-cast-type bf16": "every op auto-cast to bf16",
                 "--fast-math all": "every fp32 op cast to bf16 (neuron-cc's default, as the published inf1 rows)",
                 # the appnote says matmuls stay 16-bit, not whether bf16 or fp16
                 "--fast-math none": "matmuls cast to 16-bit (neuron-cc's most precise)"}


def precision_text(precision: str, compiler_args: str | None) -> str:
    """A measured row's precision with the compiler casting that produced it."""
    if not compiler_args:
        return precision
    meaning = _CAST_MEANING.get(compiler_args)
    return f"{precision} (compiler {compiler_args}" + (f": {meaning})" if meaning else ")")


# --- rows from the inputs ------------------------------------------------------------------------

def estimated_row(path: Path, r: BenchResult, e: EstimateBlock) -> Row:
    """An estimate of `neuron-train plan`: labelled as such wherever it is shown."""
    return Row(
        instance_type=r.instance_type.lower(), mode=r.mode, model=r.model.name,
        img_size=r.model.img_size, origin=ESTIMATED, device="Neuron (ESTIMATE from a CPU run)",
        provenance=f"estimated: {path.name} (neuron-train plan, {r.created_at[:10]}; {e.calibration})",
        precision=r.precision, batch_size=r.batch_size_per_device, world_size=r.world_size,
        samples_per_sec=r.samples_per_sec.median, spread=r.samples_per_sec.spread,
        epoch_samples=r.dataset.train_samples,
        note=f"ESTIMATE, not measured: bottleneck {e.bottleneck_text}; band {e.band[0]:,.1f}-"
             f"{e.band[1]:,.1f}")


def measured_row(path: Path, r: BenchResult) -> Row:
    """A bench result's row (a plan's estimate: `estimated_row`)."""
    if r.estimate is not None:
        return estimated_row(path, r, r.estimate)
    device = r.device
    where = f"{r.host.cpu_shown}, " if device.kind == "CPU" else ""
    how = f"measured with {device.harness}" if device.harness else "measured here"
    return Row(
        instance_type=r.instance_type.lower(), mode=r.mode, model=r.model.name,
        img_size=r.model.img_size, origin="measured", device=device_text(device),
        provenance=f"{how}: {path.name} ({where}{r.created_at[:10]})",
        precision=precision_text(r.precision, device.compiler_args),
        batch_size=r.batch_size_per_device, world_size=r.world_size,
        samples_per_sec=r.samples_per_sec.median, spread=r.samples_per_sec.spread,
        compile_time_s=r.compile.time_s, graph_count=r.compile.graph_count,
        epoch_samples=r.dataset.train_samples,
        note=f"{r.repeats} repeat(s) of {r.measured_steps} steps after {r.warmup_steps} "
             "warm-up steps")


def imported_row(ref: ReferenceRow) -> Row:
    """A published row of a Neuron SDK performance table."""
    note = "; ".join(n for n in (ref.instance_note, f"latency p50 {ref.latency_p50_ms:g} ms"
                                 if ref.latency_p50_ms else "") if n)
    return Row(
        instance_type=ref.instance_type, mode=ref.mode, model=ref.model, img_size=ref.img_size,
        origin="imported", device="Neuron (published)",
        provenance=f"imported: {ref.source} (Neuron SDK {ref.neuron_version or '?'} performance table)",
        precision=ref.precision, framework=ref.framework, batch_size=ref.batch_size,
        world_size=ref.world_size, nodes=ref.nodes,
        samples_per_sec=ref.samples_per_sec, unit=ref.unit, note=note)


def unsupported_rows(rows: list[Row], catalog: Catalog) -> list[Row]:
    """inf1 (and any type that cannot train) gets a row with the reason in each training workload."""
    train_workloads = {r.workload: r for r in rows if r.mode == "train"}
    out = []
    for itype in sorted({r.instance_type for r in rows}):
        spec = catalog.get(itype)
        if spec is None or spec.can_train:
            continue
        for key, example in train_workloads.items():
            if not any(r.instance_type == itype and r.workload == key for r in rows):
                out.append(Row(itype, "train", example.model, example.img_size, "unsupported",
                               spec.accelerator, "instance catalog", note=spec.train_note))
    return out


def mark_unsupported(rows: list[Row], catalog: Catalog) -> list[Row]:
    """A training row on a type that cannot train keeps its place but loses its figures."""
    for row in rows:
        spec = catalog.get(row.instance_type)
        if row.mode == "train" and spec is not None and not spec.can_train:
            row.note = f"{spec.train_note} (the file's figures are not used)"
            row.origin, row.samples_per_sec, row.spread = "unsupported", None, None
    return rows
