"""`neuron-train plan`'s output: the printed table and plan.json, whose `results` are bench result
files (records.py's `BenchResult`, the same versioned schema) with `source: estimated`, one per instance type that
fits, so `report` puts them beside measured and imported rows, labelled as estimates.
"""

from __future__ import annotations

import datetime as dt

from neuron_train.cost.catalog import money
from neuron_train.cost.plan.model import Calibration, Estimate, WorkloadFigures, fastest
from neuron_train.cost.records import (
    BenchResult,
    CompileFacts,
    DatasetFacts,
    Device,
    EstimateBlock,
    Host,
    ModelFacts,
    Stat,
)
from neuron_train.cost.results import PLAN_SCHEMA, PLAN_VERSION
from neuron_train.cost.schema import ESTIMATED, validate_result

ASSUMPTIONS = [
    "step = max(device compute, device memory traffic, host input pipeline, host rest) + gradient all-reduce "
    "(the overlapped parts overlap fully; the all-reduce does not overlap)",
    "device compute: dot/convolution FLOPs of the steady graph at the calibrated fraction of peak TFLOPS of the "
    "precision the matrix units run (neuronx-cc casts f32 matmuls to bf16 unless --auto-cast none)",
    "device memory traffic: the step graph's inputs and outputs once, at the core's half of the chip's bandwidth",
    "host rest, from counted facts and stated per-unit costs (never this machine's wall time): lazy = HLO "
    "instructions traced x 12 us + one dispatch; compiled (torch_neuronx.trace) = 0.1 ms dispatch per graph; "
    "replay (torch.compile) = 1 ms per graph call; processes beyond the vCPUs share them",
    "host input pipeline: this machine's CPU seconds per batch (thread CPU time), same speed per vCPU on the "
    "target, spread over max(1, min(loader workers, vCPUs per process - 1)) workers; unknown for a COMMAND",
    "all-reduce: a ring over the processes; on one chip through device memory, across chips over NeuronLink-v2 "
    "(per-link bandwidth is an assumption, see instances.yaml)",
    "memory fit: weights + gradients + optimizer state + activations per NeuronCore, data parallel (no sharding)",
    "one process per NeuronCore (data parallel) unless --nproc-per-instance; samples/s sums the processes",
    "compile time to the first step is not estimated (a CPU compile says nothing of neuronx-cc's)",
]


def estimate_result(w: WorkloadFigures, e: Estimate, calib: Calibration, *, details: dict, img_size: int | None,
                    dataset: str, epoch_samples: int | None, precision: str, command: str, created: str) -> dict:
    """One instance type's estimate as a bench result (records.py) marked `source: estimated`."""
    # Only an instance type that fits is estimated: its step, rate and band are set (plan/model.estimate).
    assert e.step_s is not None and e.samples_per_sec is not None and e.band is not None
    step_ms, batch = e.step_s * 1e3, max(1, round(w.samples_per_step))
    result = BenchResult(
        created_at=created, source=ESTIMATED, mode=w.mode, instance_type=e.instance_type,
        instance_type_source="estimated by neuron-train plan", device=Device("Neuron (estimated)", e.processes),
        world_size=e.processes,
        model=ModelFacts(w.name, details.get("parameters") or None, img_size, details.get("num_classes")),
        dataset=DatasetFacts(dataset, epoch_samples), batch_size_per_device=batch,
        global_batch_size=batch * e.processes, precision=precision, warmup_steps=0, measured_steps=1, repeats=1,
        samples_per_sec=Stat(e.samples_per_sec, (e.band[1] - e.band[0]) / 2, [e.samples_per_sec]),
        step_time_ms=Stat(step_ms, 0.0, [step_ms]), compile=CompileFacts(0.0, 0),
        estimate=EstimateBlock(e.bottleneck, e.bottleneck_text, {k: v * 1e3 for k, v in e.parts_s.items()}, e.band,
                               e.rank, e.needs_gib_per_core, calib.source),
        sweep=None, host=Host(), versions={}, command=command, config={"workload": w.to_json()})
    return validate_result(result.to_json(), f"estimate for {e.instance_type}")


def plan_document(w: WorkloadFigures, estimates: list[Estimate], calib: Calibration, *, details: dict,
                  img_size: int | None, dataset: str, epoch_samples: int | None, precision: str, command: str,
                  first_off: float | None) -> dict:
    created = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    fits = [e for e in estimates if e.fits]
    return {
        "schema": PLAN_SCHEMA, "schema_version": PLAN_VERSION, "created_at": created, "source": ESTIMATED,
        "workload": w.to_json(), "details": details,
        "calibration": {"fraction_of_peak": calib.fraction, "error_band": calib.band, "source": calib.source,
                        "first_estimate_off": first_off},
        "assumptions": ASSUMPTIONS,
        "does_not_fit": [{"instance_type": e.instance_type, "note": e.note} for e in estimates if not e.fits],
        "results": [estimate_result(w, e, calib, details=details, img_size=img_size, dataset=dataset,
                                    epoch_samples=epoch_samples, precision=precision, command=command,
                                    created=created) for e in fits],
    }


def table(w: WorkloadFigures, estimates: list[Estimate], unit: str) -> list[str]:
    """The printed table: one line per instance type, best price-performance first; every column as
    wide as its widest cell, so no figure pushes the next column out of line."""
    head = ["instance type", "procs", f"{unit}/s (estimate)", f"$/1M {unit}", "$/epoch", "rank", "bottleneck"]
    rows = []
    for e in estimates:
        if not e.fits:
            rows.append([e.instance_type, str(e.processes), "-", "-", "-", "-", e.note])
            continue
        assert e.band is not None  # set for every instance type that fits (plan/model.estimate)
        rate = f"{e.samples_per_sec:,.1f} ({e.band[0]:,.0f}-{e.band[1]:,.0f})"
        epoch = money(e.usd_per_epoch) if e.usd_per_epoch else "-"
        rows.append([e.instance_type, str(e.processes), rate, money(e.usd_per_million), epoch, str(e.rank or "-"),
                     e.bottleneck_text])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]

    def line(cells: list[str]) -> str:
        left = cells[0].ljust(widths[0])
        return " ".join([left, *(c.rjust(n) for c, n in zip(cells[1:-1], widths[1:], strict=True))]) + "  " + cells[-1]
    text = [line(head)]
    return [text[0], "-" * len(text[0]), *(line(r) for r in rows)]


def format_estimates(w: WorkloadFigures, estimates: list[Estimate], calib: Calibration) -> list[str]:
    """What plan prints of its estimates, each labelled an estimate: the workload and calibration, the
    table, a warning when the figures are an upper bound, the fastest and the best price-performance."""
    unit = "samples" if w.mode == "train" else "inferences"
    band = calib.band[w.mode]
    lines = [f"plan: ESTIMATES for {w.mode} of {w.name} ({w.measured_by}; {w.flops_per_step / 1e9:.1f} GFLOP "
             f"and {w.samples_per_step:g} samples per process step; calibration: {calib.source}, "
             f"{calib.fraction[w.mode]:.1%} of peak, band: /{1 + band:.2g} to x{1 + band:.2g})",
             *table(w, estimates, unit)]
    shortest = min(e.step_s for e in estimates if e.fits and e.step_s is not None)  # set for every one that fits
    if w.execution == "lazy" and not w.hlo_instructions and shortest < 1e-3:
        lines.append(f"plan: warning: the estimated device step is {shortest * 1e3:.3f} ms and the traced "
                     "instructions were not counted (--from-shapes): lazy tracing on the host will decide the "
                     "rate; these figures are an upper bound")
    best = next((e for e in estimates if e.rank == 1), None)
    lines.append(f"plan: estimate: fastest {fastest(estimates).instance_type}; best price-performance "
                 f"{best.instance_type if best else 'n/a (no prices)'}")
    return lines
