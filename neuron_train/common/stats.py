"""The summary of repeated measurements every product prints: the median and a spread (training's
throughput, bench's results and step times)."""

from __future__ import annotations

import statistics


def median_and_spread(values: list[float]) -> tuple[float, float]:
    """Median and the half-width of the 10th-90th percentile range."""
    if not values:
        return float("nan"), float("nan")
    if len(values) < 3:
        return statistics.median(values), (max(values) - min(values)) / 2
    deciles = statistics.quantiles(values, n=10, method="inclusive")  # stays inside the data range
    return statistics.median(values), (deciles[-1] - deciles[0]) / 2
