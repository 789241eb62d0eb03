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


@dataclass(frozen=True)
class RunSummary:
    run_dir: str
    model: str
    params: int
    device: str                          # the XLA device kind: CPU, NEURON, ...
    precision: str
    world_size: int
    batch_size: int                      # per process
    global_batch_size: int
    steps: int
    epochs: float
    measured_steps: int                  # steps in the steady-state figures
    warmup_steps_excluded: int
    compile_count: int
    compile_time_s: float
    samples_per_sec: float | None = None  # None: the run was too short to measure
    step_time_ms_median: float | None = None
    xla_execute_ms_median: float | None = None
    final_loss: float | None = None
    eval_accuracy: float | None = None
    eval_loss: float | None = None
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
        return {**out.pop("extra"), **out}
