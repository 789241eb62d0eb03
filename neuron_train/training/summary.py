"""A run's summary.json as a typed record: what `neuron-train train` prints and `bench` measures.

The loop writes the file (loop.py `_finish`); every reader goes through `RunSummary.from_json`, so a
renamed or missing key is one clear error where the file is read, not a KeyError three calls later.
Keys the record does not name (task details, optimizer memory, checksums) stay in `extra`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_train.common.errors import RunError

# Written only when the run has them (a validation set; an EMA of the weights): never as null.
_WHEN_MEASURED = ("eval_accuracy", "eval_loss", "eval_ema_accuracy", "eval_ema_loss")


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """Fields in the order summary.json has them; `extra` (task details, optimizer memory, the
    profile's bottleneck) after them."""

    model: str
    params: int
    device: str                          # the XLA device kind: CPU, NEURON, ...
    precision: str
    world_size: int
    batch_size: int                      # per process
    global_batch_size: int
    steps: int
    epochs: float
    samples_per_sec: float | None = None  # None: the run was too short to measure
    step_time_ms_median: float | None = None
    step_time_ms_spread: float | None = None
    measured_steps: int                  # steps in the steady-state figures
    warmup_steps_excluded: int
    wall_time_s: float | None = None
    compile_count: int
    compile_time_s: float
    precompile_coverage: float | None = None   # None: no --compile-cache (or a graph tour)
    xla_execute_ms_median: float | None = None
    final_loss: float | None = None
    eval_accuracy: float | None = None
    eval_loss: float | None = None
    eval_ema_accuracy: float | None = None
    eval_ema_loss: float | None = None
    param_checksums: list[float] | None = None  # one per rank when checked (the replicas agree)
    resumed_from: str | None = None
    run_dir: str
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, source: Mapping[str, Any] | Path) -> RunSummary:
        """From a summary.json file or its parsed contents. RunError (one line) when it is not one."""
        where = str(source) if isinstance(source, Path) else "summary"
        data: Any = source
        if isinstance(source, Path):
            try:
                data = json.loads(source.read_text())
            except (OSError, ValueError) as exc:
                raise RunError(f"cannot read {source}: {exc}") from None
        if not isinstance(data, Mapping):
            raise RunError(f"{where} is not a JSON object: not a neuron-train summary.json")
        fields = [f for f in dataclasses.fields(cls) if f.name != "extra"]
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in data]
        if missing:
            raise RunError(f"{where} lacks {', '.join(missing)}: not a summary.json of this neuron-train "
                           "version; run the training again")
        names = {f.name for f in fields}
        return cls(**{k: data[k] for k in names if k in data},
                   extra={k: v for k, v in data.items() if k not in names})

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        extra = out.pop("extra")
        return {**{k: v for k, v in out.items() if v is not None or k not in _WHEN_MEASURED}, **extra}
