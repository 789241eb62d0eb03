"""The run's stopwatch (training/throughput.py): when its per-step laps may stand for the steps. A real
run whose host runs ahead: tests/training/test_train.py."""

from __future__ import annotations

import pytest

from neuron_train.training.throughput import steady_step_median


def test_laps_of_a_host_running_ahead_give_no_median():
    """A 10-step ViT-Tiny run with the captured step: 5 laps of 39.7 ms while its steps took 311 ms
    (the samples/s window); the final wait for the device absorbed the rest."""
    assert steady_step_median([0.0397] * 5, window_s=5 * 0.311, measured=5) is None


def test_laps_that_caught_up_with_the_device_give_their_median():
    """A 40-step run: the first laps host-paced, then the device's queue is full and laps are its steps."""
    laps = [0.04] * 4 + [0.283] * 31
    median, _ = steady_step_median(laps, window_s=35 * 0.302, measured=35)
    assert median == pytest.approx(0.283)


def test_a_slow_lap_in_the_window_keeps_the_median():
    """A recompile in the window (5 s) weighs in the laps and in the window alike: the median stands."""
    laps = [0.1] * 20 + [5.0]
    median, _ = steady_step_median(laps, window_s=sum(laps) + 0.3, measured=21)
    assert median == pytest.approx(0.1)


def test_steps_left_out_for_evaluation_keep_the_median():
    """Every other step evaluated: its lap left out, its wait for the step still queued in the window."""
    median, _ = steady_step_median([0.1] * 10, window_s=20 * 0.1 + 10 * 0.1, measured=20)
    assert median == pytest.approx(0.1)


@pytest.mark.parametrize(("laps", "window_s", "measured"), [([], 1.0, 5), ([0.1], 0.0, 1), ([0.1], 1.0, 0)])
def test_nothing_to_time_gives_no_median(laps, window_s, measured):
    assert steady_step_median(laps, window_s, measured) is None
