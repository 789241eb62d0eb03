"""A bench result file (cost/records.py's `BenchResult`): what was measured (the workload), the figures
of its runs with their median and spread, where (`instance.py`) and with which library versions.
`bench` checks it against schema.py (`validate_result`) before writing it, so a file `report` would
refuse is never written.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from neuron_train.common.fileio import write_json_or_print
from neuron_train.common.neuron_env import library_versions
from neuron_train.common.stats import median_and_spread
from neuron_train.common.writer import Target
from neuron_train.cost.bench.instance import host_metadata
from neuron_train.cost.bench.measure import Measurement, Workload
from neuron_train.cost.records import (
    BenchResult,
    CompileFacts,
    DatasetFacts,
    Device,
    Host,
    ModelFacts,
    Stat,
    SweepRow,
)
from neuron_train.training.config import RunConfig

_VERSIONED = ("neuron-train", "torch", "torch-xla", "torchvision", "timm", "torch-neuronx",
              "neuronx-cc", "libneuronxla", "torch-neuron")


def workload_facts(cfg: RunConfig) -> tuple[int, int, int]:
    """(parameters, classes, training samples) of the configured model and dataset."""
    from neuron_train.training.build import build_data, host_model
    from neuron_train.training.models import count_parameters

    data = build_data(cfg)
    model = host_model(cfg, data.num_classes, weights=False)
    return count_parameters(model), data.num_classes, len(data.train)


def loop_workload(cfg: RunConfig, parameters: int, num_classes: int, train_samples: int) -> Workload:
    return Workload(cfg.model.name, parameters, cfg.model.img_size, num_classes, cfg.data.dataset, train_samples,
                    cfg.train.batch_size, cfg.train.precision, cfg.to_dict())


def _stat(values: list[float]) -> Stat:
    median, spread = median_and_spread(values)
    return Stat(median, spread, values)


def build_result(*, workload: Workload, mode: str, instance: tuple[str, str], runs: list[Measurement],
                 sweep_rows: list[SweepRow] | None, warmup: int, command: str) -> BenchResult:
    first = runs[0]
    compiled = [r for r in runs if r.graph_count > 0] or runs
    return BenchResult(
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), mode=mode,
        instance_type=instance[0], instance_type_source=instance[1],
        device=Device(first.device_kind, first.world_size, **first.device_info), world_size=first.world_size,
        model=ModelFacts(workload.model, workload.parameters, workload.img_size, workload.num_classes),
        dataset=DatasetFacts(workload.dataset, workload.train_samples),
        batch_size_per_device=workload.batch_size, global_batch_size=first.global_batch_size,
        precision=workload.precision, warmup_steps=warmup, measured_steps=first.measured_steps, repeats=len(runs),
        samples_per_sec=_stat([r.samples_per_sec for r in runs]), step_time_ms=_stat([r.step_time_ms for r in runs]),
        compile=CompileFacts(median_and_spread([r.compile_time_s for r in compiled])[0],
                             max(r.graph_count for r in compiled)),
        details=first.details, sweep=sweep_rows, host=Host.from_json(host_metadata()),
        versions=library_versions(_VERSIONED), command=command, config=workload.config)


def write_result(output: Target, result: dict) -> Path:
    """Write a result file whole (printed instead when it cannot be written); check it first
    (`validate_result`)."""
    return write_json_or_print(output, result, "save it as a .json file for `neuron-train report`")
