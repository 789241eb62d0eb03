"""common/stats.py: the median and spread training's throughput and bench's results print."""

from __future__ import annotations

import math

from neuron_train.common.stats import median_and_spread


def test_the_spread_is_half_the_10th_to_90th_percentile_range():
    assert median_and_spread([float(v) for v in range(1, 12)]) == (6.0, 4.0)  # deciles 2 and 10 of 1..11
    # 100 lies beyond the 90th percentile
    assert median_and_spread([5.0, 1.0, 100.0, 3.0, 2.0, 4.0, 6.0, 7.0, 8.0, 9.0, 10.0]) == (6.0, 4.0)


def test_few_values_spread_over_their_range_and_none_is_nan():
    assert median_and_spread([1.0, 3.0]) == (2.0, 1.0)
    assert median_and_spread([4.0]) == (4.0, 0.0)
    assert all(math.isnan(v) for v in median_and_spread([]))
