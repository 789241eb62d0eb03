"""What `bench` measures of our loop: every (processes, batch size) of a sweep once, then repeats of
the fastest. An out-of-memory batch size ends its process count's sweep; other failures are recorded,
not fatal.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from neuron_train.common.errors import RunError
from neuron_train.cost.bench.failures import MeasureFailed
from neuron_train.cost.bench.measure import InferBench, Measurement, measure_train
from neuron_train.cost.records import SweepRow
from neuron_train.training.config import RunConfig

DEFAULT_MEASURED_STEPS = 20          # when --max-steps is not given
DEFAULT_SWEEP_BATCH_SIZES = (8, 16, 32, 64, 128, 256)

Measure = Callable[[int, int], Measurement]   # (batch size per device, processes) -> one measurement
Log = Callable[[str], None]


@dataclass
class SweepPlan:
    mode: str
    batch_sizes: list[int]
    nprocs: list[int]
    repeats: int


def sweep(plan: SweepPlan, measure: Measure, log: Log) -> tuple[list[SweepRow], dict[tuple[int, int], Measurement]]:
    """Measure every (processes, batch size) once; after an OOM, larger batches are not tried.

    Returns the sweep rows (ok / oom / failed, with the reason) and the successful measurements.
    """
    rows: list[SweepRow] = []
    ok: dict[tuple[int, int], Measurement] = {}
    for nproc in plan.nprocs:
        for bs in plan.batch_sizes:
            try:
                m = measure(bs, nproc)
            except MeasureFailed as exc:
                log(f"  batch {bs} x {nproc} process(es): {exc.status}: {exc.reason}")
                last = exc.status == "oom"
                rows.append(SweepRow(bs, nproc, exc.status,
                                     exc.reason + (" (larger batch sizes not tried)" if last else "")))
                if last:
                    break
                continue
            ok[(nproc, bs)] = m
            rows.append(SweepRow(bs, m.world_size, "ok", "", m.samples_per_sec, m.step_time_ms, m.compile_time_s,
                                 m.graph_count))
            log(f"  batch {bs} x {nproc} process(es): {m.samples_per_sec:.1f} samples/s")
    return rows, ok


def repeat_fastest(plan: SweepPlan, measure: Measure, sweeping: bool,
                   log: Log) -> tuple[list[SweepRow], list[Measurement], tuple[int, int]]:
    """The sweep (or the one configuration), then the repeats of the fastest: (sweep rows, runs,
    (processes, batch size) measured)."""
    rows, ok = sweep(plan, measure, log)
    if not ok:
        reasons = "; ".join(f"batch {r.batch_size_per_device}: {r.reason}" for r in rows)
        raise RunError(f"no configuration could be measured ({reasons})")
    (nproc, bs), best = max(ok.items(), key=lambda kv: kv[1].samples_per_sec)
    if sweeping:
        log(f"bench: fastest is batch {bs} x {nproc} process(es); measuring it "
            f"{plan.repeats - 1} more time(s)")
    runs = [best]
    for i in range(plan.repeats - 1):
        try:
            runs.append(measure(bs, nproc))
        except MeasureFailed as exc:
            raise RunError(f"repeat {i + 2} of batch {bs} x {nproc} failed: {exc.reason}") from None
        log(f"  repeat {i + 2}: {runs[-1].samples_per_sec:.1f} samples/s")
    return rows, runs, (nproc, bs)


def measure_loop(plan: SweepPlan, cfg: RunConfig, instance_type: str, num_classes: int, measured: int,
                 sweeping: bool, log: Log) -> tuple[list[SweepRow], list[Measurement], tuple[int, int]]:
    """Our loop's sweep and repeats (`repeat_fastest`): train mode runs the loop (`measure_train`),
    infer mode times its compiled forward pass (`InferBench`), each in one temporary folder."""
    with tempfile.TemporaryDirectory(prefix="neuron-train-bench-") as tmp:
        if plan.mode == "train":
            def measure(bs: int, nproc: int) -> Measurement:
                return measure_train(replace(cfg, train=replace(cfg.train, batch_size=bs)), nproc, Path(tmp))
        else:
            bench = InferBench(cfg, num_classes, instance_type, Path(tmp))

            def measure(bs: int, nproc: int) -> Measurement:
                return bench.measure(bs, measured, cfg.train.warmup_measure_steps)

        return repeat_fastest(plan, measure, sweeping, log)
