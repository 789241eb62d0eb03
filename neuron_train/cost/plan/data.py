"""The data `neuron-train plan` stands on: instance types with their chips (instances.yaml,
plan_hardware) and the published Neuron rows with their architectures (plan_published.yaml).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from neuron_train.common import reader
from neuron_train.common.errors import UsageError
from neuron_train.common.values import shown
from neuron_train.cost import catalog as instance_catalog
from neuron_train.cost.catalog import Catalog, load_catalog, read_mapping
from neuron_train.cost.plan.model import Chip, HostCosts, Target, WorkloadFigures
from neuron_train.cost.schema import Fields

PUBLISHED_PATH = Path(__file__).resolve().parents[2] / "data" / "plan_published.yaml"
BYTES_BF16, BYTES_FP32 = 2, 4
IMAGE_BYTES = 3 * 224 * 224 * 4     # one f32 224 x 224 image: every image row of the tables


def load_chips(path: Path | None = None) -> dict[str, Chip]:
    """The chips of instances.yaml's plan_hardware (the catalog's file, read when called), each field checked
    (read as the catalog reads it)."""
    path = path or instance_catalog.CATALOG_PATH
    data = Fields(read_mapping(path, ours=True), str(path))
    data.check("plan_hardware", "object")
    return {name: _chip(name, c, f"{path} plan_hardware.{name}") for name, c in data.data["plan_hardware"].items()}


def _chip(name: str, c: object, where: str) -> Chip:
    f = Fields.of(c, where)
    f.count("cores_per_chip")
    f.check("peak_tflops_per_chip", "object")
    for precision in f.data["peak_tflops_per_chip"]:
        f.check(f"peak_tflops_per_chip.{precision}", "number>=0")  # 0: the chip has no such matrix unit
    for field in ("memory_gib_per_chip", "memory_gib_per_s_per_chip", "link_gb_per_s"):
        f.check(field, "number>0")
    f.count("chip_links", least=0)
    f.text("source")
    d = f.data
    return Chip(name, d["cores_per_chip"], {k: float(v) for k, v in d["peak_tflops_per_chip"].items()},
                float(d["memory_gib_per_chip"]), float(d["memory_gib_per_s_per_chip"]), d["chip_links"],
                float(d["link_gb_per_s"]), d["source"], _host_costs(d.get("host_costs", {}), f"{where}.host_costs"))


def _host_costs(raw: object, where: str) -> HostCosts:
    """A chip's `host_costs`: any of HostCosts' fields, each a number (the rest keep their defaults)."""
    f = Fields.of(raw, where)
    names = [field.name for field in dataclasses.fields(HostCosts)]
    f.only(names)
    for name in f.data:
        f.check(name, "number>0" if name == "copy_bytes_per_s" else "number>=0")
    return HostCosts(**{k: float(v) for k, v in f.data.items()})


def targets(catalog: Catalog | None = None, chips: dict[str, Chip] | None = None) -> dict[str, Target]:
    """Every Neuron instance type of the catalog that the estimate can model."""
    catalog = catalog or load_catalog()
    chips = chips or load_chips()
    out = {}
    for name, spec in catalog.instances.items():
        if spec.accelerator in chips:
            price = catalog.price(name)
            out[name] = Target(name, spec.accelerators, spec.cores, spec.vcpus,
                               price.usd_per_hour if price else None, spec.can_train, chips[spec.accelerator])
    return out


def choose_targets(all_targets: dict[str, Target], wanted: list[str] | None, mode: str) -> list[Target]:
    """The instance types to estimate: the ones named, else every trn1/inf2 (inf1 too in inference)."""
    if wanted:
        unknown = [w for w in wanted if w.lower() not in all_targets]
        if unknown:
            raise UsageError(f"--instances: unknown instance type {unknown[0]!r} (known: "
                             f"{', '.join(sorted(all_targets))})")
        chosen = [all_targets[w.lower()] for w in wanted]
        cannot = [t.instance_type for t in chosen if mode == "train" and not t.can_train]
        if cannot:
            raise UsageError(f"--instances: {cannot[0]} cannot train (inference only): drop it or use --mode infer")
        return chosen
    return [t for t in all_targets.values() if mode == "infer" or t.can_train]


def wanted_instances(text: str | None) -> list[str] | None:
    """`--instances` as each type once, in the order given, whatever its case (`trn1.2xlarge,TRN1.2xlarge`
    is one row); a list that names none is refused."""
    if text is None:
        return None
    names = list(dict.fromkeys(s.strip().lower() for s in text.split(",") if s.strip()))
    if not names:
        raise UsageError(f"--instances: no instance type in {shown(text)}: give e.g. trn1.2xlarge,inf2.xlarge")
    return names


def capped_note(processes: int | None, chosen: list[Target]) -> str | None:
    """The line saying --nproc-per-instance is more than some types' NeuronCores (estimated with
    their cores there), else None."""
    over = [t for t in chosen if processes and processes > t.cores]
    if not over:
        return None
    names = ", ".join(f"{t.instance_type} ({t.cores})" for t in over[:4]) + (", ..." if len(over) > 4 else "")
    return (f"plan: warning: --nproc-per-instance {processes} is more than the NeuronCores of {names}: capped "
            "at each one's cores")


# --- published rows -------------------------------------------------------------------------------

@dataclass(frozen=True)
class PublishedRow:
    model: str
    arch: str
    mode: str
    instance_type: str
    nodes: int
    batch_per_core: int
    seq: int | None
    precision: str
    samples_per_sec: float
    sdk: str
    file: str
    model_shards: int = 1
    workers: int | None = None        # processes per instance as the row ran (None: one per NeuronCore)
    global_batch: int | None = None   # training: samples per update over every core and node (accumulation)
    setup: str | None = None          # training: the table's "Training Data-Type" (Autocast:BF16+SR, FP32, ...)
    optimizer: str | None = None

    @classmethod
    def from_json(cls, d: object, where: str) -> PublishedRow:
        f = Fields.of(d, where)
        f.text("model", "arch", "mode", "instance_type")
        f.count("nodes", "batch_per_core")
        f.count("seq", null=True)
        f.text("precision")
        f.check("samples_per_sec", "number>0")
        f.text("sdk", "file")
        f.count("model_shards", required=False)
        f.count("workers", "global_batch", required=False, null=True)
        f.text("setup", "optimizer", required=False, null=True)
        f.only(field.name for field in dataclasses.fields(cls))
        return cls(**f.data)

    @property
    def workload_key(self) -> tuple:
        """What a row measures, release aside: rows with the same key are one workload at several releases."""
        return (self.model, self.mode, self.instance_type, self.nodes, self.batch_per_core, self.seq, self.setup,
                self.global_batch, self.optimizer, self.workers)

    @property
    def release(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.sdk.split("."))

    @property
    def label(self) -> str:
        setup = f" ({self.setup}, microbatch {self.batch_per_core})" if self.setup else ""
        return (f"{self.model}{setup} on {self.instance_type}" + (f" x {self.nodes}" if self.nodes > 1 else "")
                + f" [{self.sdk}]")


def newest(rows: list[PublishedRow]) -> list[PublishedRow]:
    """The newest release's row of each workload (the calibration's rows; older releases measure the drift)."""
    best: dict[tuple, PublishedRow] = {}
    for r in rows:
        if r.workload_key not in best or r.release > best[r.workload_key].release:
            best[r.workload_key] = r
    return list(best.values())


def processes(row: PublishedRow, cores: int) -> int:
    """The processes per instance the row ran: its workers when the table says, else one per NeuronCore."""
    return row.workers or cores


@dataclass(frozen=True)
class Architecture:
    """A published row's model, by its sizes (plan_published.yaml's formula): a CNN by its multiply-adds,
    a transformer by its layers, a model without a formula by its counted training FLOPs."""

    kind: str                       # "cnn", "counted" or a transformer's ("encoder", "decoder", ...)
    params_m: float
    source: str
    gmacs: float = 0.0              # cnn: forward multiply-adds of one sample, in billions
    train_gflops: float = 0.0       # counted: one training sample's FLOPs, in billions
    hidden: int = 0
    ffn: int = 0
    layers: int = 0
    tokens: int | None = None       # a transformer's sequence when its rows do not say (a ViT's patches)
    gqa_kv_fraction: float = 1.0
    gated_ffn: bool = False
    extra_gflops: float = 0.0
    output_vocab: int = 0           # an LM head's vocabulary: its logits are counted and copied back
    train_instructions: int = 0     # the counted instructions of its training step's graph

    @classmethod
    def from_json(cls, d: object, where: str) -> Architecture:
        f = Fields.of(d, where)
        f.text("kind", "source")
        f.check("params_m", "number>0")
        for name in ("gmacs", "train_gflops", "gqa_kv_fraction", "extra_gflops"):
            f.check(name, "number>=0", required=False)
        f.count("hidden", "ffn", "layers", "tokens", "output_vocab", "train_instructions", least=0, required=False)
        if not isinstance(f.data.get("gated_ffn", False), bool):
            raise UsageError(f"{where}: field 'gated_ffn' must be true or false, got {shown(f.data['gated_ffn'])}")
        f.only(field.name for field in dataclasses.fields(cls))
        return cls(**f.data)


def forward_flops(arch: Architecture, seq: int | None) -> float:
    """Forward FLOPs of one sample from the architecture's sizes (the formula in plan_published.yaml)."""
    if arch.kind == "counted":     # no formula: a third of the training step's counted FLOPs
        return arch.train_gflops * 1e9 / 3
    if arch.kind == "cnn":
        return 2 * arch.gmacs * 1e9
    tokens = arch.tokens or seq
    assert tokens is not None, "a transformer architecture needs its `tokens` or the row's `seq`"
    d, ffn, layers = arch.hidden, arch.ffn, arch.layers
    attn_proj = 2 * d * d * (1 + arch.gqa_kv_fraction)
    mlp = (3 if arch.gated_ffn else 2) * d * ffn
    return (2 * tokens * layers * (attn_proj + mlp) + 4 * layers * tokens * tokens * d
            + 2 * tokens * d * arch.output_vocab + arch.extra_gflops * 1e9)


def load_published(path: Path = PUBLISHED_PATH) -> tuple[list[PublishedRow], dict[str, Architecture]]:
    """The published rows and their architectures, each field checked (read through common/reader.py)."""
    data = Fields.of(reader.load(path, fmt="yaml"), str(path))
    data.check("rows", "list")
    data.check("architectures", "object")
    archs = {name: Architecture.from_json(a, f"{path} architectures.{name}")
             for name, a in data.data["architectures"].items()}
    rows = [PublishedRow.from_json(r, f"{path} rows[{i}]") for i, r in enumerate(data.data["rows"])]
    unknown = next((r for r in rows if r.arch not in archs), None)
    if unknown is not None:
        raise UsageError(f"{path}: the row {unknown.label} names the architecture {shown(unknown.arch)}, "
                         "which architectures does not describe")
    return rows, archs


def published_workload(row: PublishedRow, arch: Architecture, cores: int) -> WorkloadFigures:
    """One process (NeuronCore) of a published row as it ran: a model replica spans `model_shards` cores,
    so a core does 1/shards of a replica's work and holds 1/shards of its weights. A training row traces
    its step lazily (torch-neuronx), the architecture's counted instructions, decodes its images in the
    training process (the examples' default loader) and all-reduces once per global batch; an inference
    row runs a compiled model on tensors already made and copies its result back (an LM head's f32 logits)."""
    train = row.mode == "train"
    accumulation = max(1, (row.global_batch or 0) // (row.batch_per_core * processes(row, cores) * row.nodes))
    flops = forward_flops(arch, row.seq) * (3 if train else 1)
    params = arch.params_m * 1e6 / row.model_shards
    per_step = row.batch_per_core / row.model_shards
    weights = params * BYTES_BF16
    return WorkloadFigures(
        name=row.model, mode=row.mode, flops_per_step=flops * per_step,
        conv_flops=flops * per_step if arch.kind == "cnn" else 0.0,   # a CNN's FLOPs: its convolutions
        input_bytes=per_step * (row.seq * 8 if row.seq else IMAGE_BYTES),  # token ids (int64) or an f32 image
        output_bytes=0.0 if train else per_step * (row.seq or 0) * arch.output_vocab * BYTES_FP32,  # logits
        precision=row.precision, bytes_per_step=weights * (3 if train else 1), samples_per_step=per_step,
        param_bytes=params * BYTES_FP32 if train else weights, grad_bytes=params * BYTES_FP32 if train else 0.0,
        optimizer_bytes=params * 2 * BYTES_FP32 if train else 0.0, activation_bytes=0.0,
        execution="lazy" if train else "compiled", hlo_instructions=arch.train_instructions if train else 0,
        decoded_images=per_step if train and row.seq is None else 0.0, loader_workers=0, grad_accumulation=accumulation,
        measured_by=f"published row ({row.file}, Neuron SDK {row.sdk}); FLOPs from the architecture")
