"""Run outputs on rank 0: metrics.jsonl, TensorBoard scalars, the progress bar, summary.json.

Values arrive from step closures that run after the step's graph has executed, so writing them
never stalls the training loop.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.fh = open(self.path, "a", buffering=1)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, step: int, values: dict[str, float], kind: str = "train") -> None:
        self.fh.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
        if self.tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self.tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self.fh.close()
        if self.tb is not None:
            self.tb.close()


class Progress:
    """A rank-0 progress bar (tqdm); silent elsewhere or when disabled."""

    def __init__(self, enabled: bool, total: int, initial: int):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            mininterval=0.5)

    def advance(self, postfix: dict[str, str] | None = None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def median_and_spread(values: list[float]) -> tuple[float, float]:
    """Median and the half-width of the 10th-90th percentile range."""
    if not values:
        return float("nan"), float("nan")
    if len(values) < 3:
        return statistics.median(values), (max(values) - min(values)) / 2
    deciles = statistics.quantiles(values, n=10, method="inclusive")  # stays inside the data range
    return statistics.median(values), (deciles[-1] - deciles[0]) / 2


