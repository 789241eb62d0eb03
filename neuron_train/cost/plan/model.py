"""The estimate of `neuron-train plan`: step time, throughput and cost of one workload on one
instance type, from what a CPU run measured and the hardware facts (pure; docs/plan.md).

Per process (one NeuronCore, data parallel), step time =
    max(device compute, device memory traffic, host input pipeline, host rest)   (they overlap)
  + gradient all-reduce (training only; not overlapped with the step: an assumption)
where device compute = dot FLOPs / (peak TFLOPS of the precision x the calibrated fraction of peak)
+ convolution FLOPs / (the same x the convolutions' fraction) + the batch's copy to the device and
the result's back,
memory traffic = bytes in and out of the step's graph / the core's share of device memory bandwidth,
the host input pipeline = its CPU-seconds per batch / the data workers a process gets on the target
(vCPUs / processes - 1 for the process itself, at most the loader's workers, at least 1), the host
rest = the target host's term for how the step is executed (host_rest_s: counted facts x stated
per-unit costs, never the planning machine's wall time), and the all-reduce is a ring:
2 (P-1)/P x gradient bytes / the ring's bandwidth.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace

from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.values import shown
from neuron_train.cost.schema import Fields

GIB = 1024 ** 3
UNKNOWN = "unknown"     # what a COMMAND did not tell: never a guess written as if measured


@dataclass(frozen=True)
class HostCosts:
    """Per-unit costs of the target's host, never the planning machine's (whose wall time moves with its
    load): a field of each chip (`Chip.host`; instances.yaml's `plan_hardware.<chip>.host_costs` overrides
    any of them for the instances of that chip). The shipped tracing and image costs are fitted on the
    published training rows (plan/calibrate.fit_host: `HostFit`, laid over the chip's); these defaults
    stand only where no training row with counted instructions is given (12 us: thread CPU time per
    instruction measured on a quiet planning machine, an upper bound of the target's). docs/plan.md."""

    trace_s_per_instruction: float = 12e-6   # lazy tracing, seconds per unoptimized HLO instruction of the step
    image_s: float = 0.0                     # the input pipeline's seconds per image decoded and preprocessed
    dispatch_s: float = 0.1e-3               # one graph execution handed to the Neuron runtime (assumption)
    replay_s: float = 1e-3                   # one torch.compile graph call: guards + cached-graph dispatch (assumption)
    copy_bytes_per_s: float = 4e9            # host -> device copy of a step's batch, per NeuronCore (calibrated)


@dataclass(frozen=True)
class HostFit:
    """The host costs a calibration fitted (plan/calibrate.fit_host), laid over each target chip's own."""

    trace_s_per_instruction: float
    image_s: float


@dataclass(frozen=True)
class Chip:
    """One accelerator chip's facts (neuron_train/data/instances.yaml, plan_hardware)."""

    name: str
    cores: int
    peak_tflops: dict[str, float]     # per chip, by matmul precision
    memory_gib: float
    memory_gib_per_s: float
    links: int
    link_gb_per_s: float
    source: str
    host: HostCosts = HostCosts()     # the per-unit costs of the hosts this chip sits in

    @property
    def memory_gib_per_core(self) -> float:
        return self.memory_gib / self.cores


@dataclass(frozen=True)
class Target:
    """An instance type as the estimate sees it."""

    instance_type: str
    chips: int
    cores: int
    vcpus: int
    usd_per_hour: float | None
    can_train: bool
    chip: Chip


@dataclass(frozen=True)
class WorkloadFigures:
    """What one process's steady step does (measured on CPU, or counted from shapes)."""

    name: str
    mode: str                       # train | infer
    flops_per_step: float           # dot + convolution FLOPs of the steady graph, one process
    precision: str                  # what the matrix units run: bf16 | fp16 | fp32
    bytes_per_step: float           # bytes in and out of the steady graph (device memory traffic)
    samples_per_step: float         # one process
    param_bytes: float
    grad_bytes: float               # what a data-parallel all-reduce moves each step
    optimizer_bytes: float
    activation_bytes: float         # saved for the backward (0 in inference)
    host_input_s: float | None = 0.0  # CPU-seconds per batch of the input pipeline (thread CPU time); None: unknown
    loader_workers: int = 0         # 0: the input pipeline runs in the training process
    execution: str = "lazy"         # how the target runs a step: lazy | compiled | replay (EXECUTIONS)
    hlo_instructions: int = 0       # instructions of the steady step's unoptimized HLO (what lazy tracing builds)
    graphs_per_step: int = 1        # graph executions the host dispatches per step
    conv_flops: float = 0.0         # the convolutions' share of flops_per_step (their own fraction of peak)
    input_bytes: float = 0.0        # the batch copied from the host to the device each step
    output_bytes: float = 0.0       # the step's result copied back to the host (an LM head's logits in inference)
    decoded_images: float = 0.0     # images the host decodes and preprocesses per step (workload-defined input cost)
    grad_accumulation: int = 1      # steps per gradient all-reduce (microbatches accumulated before the update)
    measured_by: str = "measured on the CPU XLA device"

    def to_json(self) -> dict[str, object]:
        """The figures as plan writes them (plan.json's `workload`, each estimate's `config.workload`), every
        field, "unknown" for what the run did not tell (a COMMAND's input pipeline)."""
        return {k: UNKNOWN if v is None else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: object, where: str) -> WorkloadFigures:
        """A workload as plan wrote it (`to_json`; scripts/plan_standins.json keeps them), each field checked;
        a field with a default may be missing (a file written before the field was)."""
        f = Fields.of(data, where)
        fields = dataclasses.fields(cls)
        f.only(x.name for x in fields)
        if f.data.get("host_input_s") == UNKNOWN:
            f = Fields({**f.data, "host_input_s": None}, where)
        for x in fields:
            f.check(x.name, _WORKLOAD_KINDS.get(x.name, "number>=0"), required=x.default is dataclasses.MISSING,
                     null=x.name == "host_input_s")
        for name, known in (("mode", ("train", "infer")), ("execution", tuple(EXECUTIONS))):
            if name in f.data and f.data[name] not in known:
                raise UsageError(f"{where}: field '{name}' must be one of {', '.join(known)}, "
                                 f"got {shown(f.data[name])}")
        return cls(**f.data)


# WorkloadFigures' fields that are not a number >= 0 (common/values.py's kinds)
_WORKLOAD_KINDS = {"name": "str", "mode": "str", "precision": "str", "execution": "str", "measured_by": "str",
                   "samples_per_step": "number>0", "loader_workers": "int>=0", "hlo_instructions": "int>=0",
                   "graphs_per_step": "int>=0", "grad_accumulation": "int>=1"}


@dataclass(frozen=True)
class Calibration:
    """Achieved fraction of peak compute per mode, and the relative error band of the estimate."""

    fraction: dict[str, float]      # mode -> fraction of peak of dots; "<mode>-conv" -> of convolutions
    band: dict[str, float]          # mode -> error factor (e.g. 0.3: the rate / 1.3 .. x 1.3)
    source: str
    host: HostFit | None = None     # the tracing and image costs fitted (None: each target chip's own)

    def conv_fraction(self, mode: str) -> float:
        """Convolutions' achieved fraction of peak (the dots' when no convolution row calibrated it)."""
        return self.fraction.get(f"{mode}-conv", self.fraction[mode])

    def host_on(self, chip: Chip) -> HostCosts:
        """The target host's per-unit costs: the chip's, with the tracing and image costs fitted over them."""
        if self.host is None:
            return chip.host
        return replace(chip.host, trace_s_per_instruction=self.host.trace_s_per_instruction, image_s=self.host.image_s)


@dataclass
class Estimate:
    instance_type: str
    processes: int
    fits: bool
    needs_gib_per_core: float
    has_gib_per_core: float
    samples_per_sec: float | None = None
    step_s: float | None = None
    parts_s: dict[str, float] = field(default_factory=dict)
    bottleneck: str = ""
    bottleneck_text: str = ""
    band: tuple[float, float] | None = None
    usd_per_hour: float | None = None
    usd_per_million: float | None = None
    usd_per_epoch: float | None = None
    rank: int | None = None
    note: str = ""
    vcpus_per_core: float = 0.0


BOTTLENECKS = {"compute": "device compute", "memory": "device memory bandwidth",
               "host_input": "host input pipeline", "host_rest": "host (tracing, dispatch)",
               "allreduce": "gradient all-reduce"}

# How the target's host runs one step (docs/plan.md, "The host term"):
EXECUTIONS = {
    "lazy": "torch_xla traces every op of the step on the host each step (overlapping the device's previous step)",
    "compiled": "a compiled model (torch_neuronx.trace) is dispatched: no tracing",
    "replay": "torch.compile replays captured graphs: guards and dispatch, no tracing",
}




def host_rest_s(w: WorkloadFigures, processes: int, vcpus: int, host: HostCosts) -> float:
    """The target host's seconds per step outside the input pipeline: a pure function of counted facts
    (instructions, graph executions) and the stated per-unit costs; processes beyond the vCPUs share them."""
    if w.execution == "compiled":
        per_step = w.graphs_per_step * host.dispatch_s
    elif w.execution == "replay":
        per_step = w.graphs_per_step * host.replay_s
    else:
        per_step = w.hlo_instructions * host.trace_s_per_instruction + w.graphs_per_step * host.dispatch_s
    return per_step * max(1.0, processes / max(vcpus, 1))


def memory_needed_gib(w: WorkloadFigures) -> float:
    """Device memory one data-parallel process needs: weights, gradients, optimizer state, activations."""
    return (w.param_bytes + w.grad_bytes + w.optimizer_bytes + w.activation_bytes) / GIB


def allreduce_s(grad_bytes: float, processes: int, t: Target) -> float:
    """A ring all-reduce over the processes: 2 (P-1)/P x bytes over the slowest hop. Cores of one
    chip exchange through its device memory; chips through NeuronLink (two links per ring)."""
    if processes <= 1 or grad_bytes <= 0:
        return 0.0
    chips_used = math.ceil(processes / t.chip.cores)
    if chips_used <= 1:
        bandwidth = t.chip.memory_gib_per_s * GIB / 2           # read + write through the chip's memory
    else:
        bandwidth = max(t.chip.links // 2, 1) * t.chip.link_gb_per_s * 1e9
    return 2 * (processes - 1) / processes * grad_bytes / bandwidth


def _parts(w: WorkloadFigures, t: Target, c: Calibration, processes: int) -> dict[str, float]:
    peak = t.chip.peak_tflops.get(w.precision) or t.chip.peak_tflops["bf16"]
    per_core_peak = peak * 1e12 / t.chip.cores
    dots = max(w.flops_per_step - w.conv_flops, 0.0)
    per_core_bw = t.chip.memory_gib_per_s * GIB / t.chip.cores
    # Each process's own thread (tracing, dispatch) keeps one vCPU busy; its loader workers share the rest.
    workers = max(1.0, min(float(w.loader_workers or 1), t.vcpus / processes - 1))
    host = c.host_on(t.chip)
    # The batch's copy to the device and the result's copy back are in series with the step's compute.
    compute = (dots / (per_core_peak * c.fraction[w.mode]) + w.conv_flops / (per_core_peak * c.conv_fraction(w.mode))
               + (w.input_bytes + w.output_bytes) / host.copy_bytes_per_s)
    host_input = (w.host_input_s or 0.0) + w.decoded_images * host.image_s
    parts = {"compute": compute, "memory": w.bytes_per_step / per_core_bw, "host_input": host_input / workers,
             "host_rest": host_rest_s(w, processes, t.vcpus, host)}
    if w.loader_workers == 0:  # the input pipeline runs in the training process, in series with the rest
        parts["host_rest"] += parts.pop("host_input")
    if w.mode == "train":  # one all-reduce per update: accumulated microbatches share it
        parts["allreduce"] = allreduce_s(w.grad_bytes, processes, t) / max(w.grad_accumulation, 1)
    return parts


def estimate(w: WorkloadFigures, t: Target, c: Calibration, processes: int | None = None,
             epoch_samples: int | None = None) -> Estimate:
    """One instance type's estimate (processes: one per NeuronCore unless given)."""
    processes = processes or t.cores
    need, has = memory_needed_gib(w), t.chip.memory_gib_per_core
    est = Estimate(t.instance_type, processes, need <= has, need, has, vcpus_per_core=t.vcpus / t.cores)
    if not est.fits:
        est.note = f"does not fit in device memory: needs {need:.1f} GiB per NeuronCore, has {has:g}"
        return est
    parts = _parts(w, t, c, processes)
    overlapped = {k: v for k, v in parts.items() if k != "allreduce"}
    slowest = max(overlapped, key=lambda k: overlapped[k])
    est.step_s = overlapped[slowest] + parts.get("allreduce", 0.0)
    est.parts_s = parts
    est.bottleneck = "allreduce" if parts.get("allreduce", 0.0) > overlapped[slowest] else slowest
    est.bottleneck_text = f"{BOTTLENECKS[est.bottleneck]} {parts[est.bottleneck] * 1e3:.2f} ms/step"
    est.samples_per_sec = w.samples_per_step * processes / est.step_s
    band = c.band[w.mode]
    est.band = (est.samples_per_sec / (1 + band), est.samples_per_sec * (1 + band))
    if t.usd_per_hour:
        est.usd_per_hour = t.usd_per_hour
        est.usd_per_million = t.usd_per_hour / (est.samples_per_sec * 3600) * 1e6
        if epoch_samples:
            est.usd_per_epoch = epoch_samples / (est.samples_per_sec * 3600) * t.usd_per_hour
    return est


def fastest(estimates: list[Estimate]) -> Estimate:
    """The fastest type that fits; of types the model rates equal (the same chip and processes), the one
    with more host vCPUs per NeuronCore: the published encoder rows run 2-10% faster on trn1.2xlarge
    (8 vCPUs) than on inf2.xlarge (4 vCPUs, the same chip) in 13 of 13 pairs of the 2.16 tables
    (plan_published.yaml)."""
    return max((e for e in estimates if e.fits), key=lambda e: (e.samples_per_sec or 0.0, e.vcpus_per_core))


def rank_by_price_performance(estimates: list[Estimate]) -> list[Estimate]:
    """Cheapest per sample first (1 = best); rows without a price or that do not fit come last."""
    ranked = sorted(estimates, key=lambda e: (e.usd_per_million is None, e.usd_per_million or 0.0))
    for i, e in enumerate(r for r in ranked if r.usd_per_million is not None):
        e.rank = i + 1
    return ranked


def estimate_all(w: WorkloadFigures, targets: list[Target], c: Calibration, processes: int | None,
                 epoch_samples: int | None) -> list[Estimate]:
    """Every target's estimate, best price-performance first (processes per instance: at most its
    NeuronCores; None: one per NeuronCore). A workload that fits on none of them is an error."""
    ests = [estimate(w, t, c, min(processes, t.cores) if processes else None, epoch_samples) for t in targets]
    if not any(e.fits for e in ests):
        most = max(t.chip.memory_gib_per_core for t in targets)
        raise RunError(f"{w.name} does not fit on any instance type estimated: needs "
                       f"{memory_needed_gib(w):.1f} GiB per NeuronCore, has {most:g} (data parallel, nothing "
                       "sharded): use a smaller batch, ZeRO-1 (--zero1) or a model-parallel library")
    return rank_by_price_performance(ests)
