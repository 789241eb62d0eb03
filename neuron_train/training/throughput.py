"""The run's stopwatch: steady-state throughput, measured the same way for every step path.

The clock starts after `warmup_measure_steps` steps (compiles happen there), from an idle device,
and stops on an idle device at the end. Time spent evaluating or checkpointing is taken out of the
window, and steps that did either are left out of the step-time median.

A step's lap ends when the host has traced (or launched) it, not when the device has run it. Once the
device's queue is full the two paces agree; in a short window of a captured step path they do not: the
host launches every step in a fraction of its device time and the final wait absorbs the rest. There
the laps time the host, and the summary gives no step-time median (`steady_step_median`).
"""

from __future__ import annotations

import statistics
import time

import torch_xla
import torch_xla.core.xla_model as xm

from neuron_train.common.stats import median_and_spread

# Laps whose mean is below this share of the window's mean step timed the host running ahead of the
# device (seen: a 10-step ViT-Tiny run's laps 39.7 ms, its steps 311 ms; a 40-step run's 283 and 302).
HOST_AHEAD_SHARE = 0.5


def steady_step_median(laps: list[float], window_s: float, measured: int) -> tuple[float, float] | None:
    """The laps' median and spread (seconds), or None where they cannot stand for the steps: none were
    timed, or their mean is under HOST_AHEAD_SHARE of the window's mean step (the host ran ahead).
    Means, not medians, are compared: a slow lap (a recompile) weighs in both alike. A step left out
    of the laps (eval, checkpoint) counts in the window's mean with its wait for the steps queued."""
    if not laps or measured <= 0 or window_s <= 0:
        return None
    if statistics.fmean(laps) < HOST_AHEAD_SHARE * window_s / measured:
        return None
    return median_and_spread(laps)


def _sync_keeping_seed() -> None:
    """torch_xla.sync(), then the XLA seed set back to what it was before it. Every sync advances the
    seed; this one comes `warmup_measure_steps` after the run's first step, so a resumed run would
    have it at another step than the uninterrupted run, and draw other random numbers (drop-path)
    from then on. The base seed is read before the sync (a device-data read, no graph runs)."""
    device = torch_xla._XLAC._xla_get_default_device()
    # an int64 tensor: a seed of 2**63 or more comes back negative, the setter wants the uint64
    base = int(torch_xla._XLAC._get_base_seed_as_tensor(str(device)).cpu().item()) % 2**64
    torch_xla.sync()
    xm.set_rng_state(base)


class Throughput:
    def __init__(self, first_step: int, warmup_steps: int):
        self.measure_from = first_step + warmup_steps  # steps done when the clock starts
        self.warmup_steps = warmup_steps
        self.start = time.perf_counter()              # the whole run's wall clock
        self.end: float | None = None
        self.t0: float | None = None                  # the measured window's start
        self.t_prev: float | None = None
        self.excluded = 0.0                           # eval/checkpoint seconds inside the window
        self.step_times: list[float] = []
        self.last_step = first_step

    def step_traced(self, steps_done: int) -> None:
        """After a step's tracing: when warm-up ends, start the clock on an idle device."""
        self.last_step = steps_done
        if steps_done == self.measure_from:
            _sync_keeping_seed()
            xm.wait_device_ops()  # host waits for the device: the window starts with nothing queued
            self.t0 = self.t_prev = time.perf_counter()
            self.excluded = 0.0

    def lap(self, extras_s: float) -> None:
        """After the step's end-of-step work; `extras_s` seconds of it (eval, checkpoint) don't count."""
        now = time.perf_counter()
        if self.t_prev is not None and self.last_step > self.measure_from:
            if extras_s == 0.0:
                self.step_times.append(now - self.t_prev)
            self.excluded += extras_s
        self.t_prev = now

    def stop(self) -> None:
        torch_xla.sync()
        xm.wait_device_ops()  # host waits for the last step: the window ends on an idle device
        self.end = time.perf_counter()

    def figures(self, global_batch: int) -> dict:
        """The summary's speed figures (None where the run was too short to measure)."""
        end = self.end if self.end is not None else time.perf_counter()
        measured = max(0, self.last_step - self.measure_from)
        window = (end - self.t0 - self.excluded) if self.t0 is not None else 0.0
        steady = steady_step_median(self.step_times, window, measured)
        return {
            "samples_per_sec": measured * global_batch / window if window > 0 and measured > 0 else None,
            "step_time_ms_median": steady[0] * 1e3 if steady else None,
            "step_time_ms_spread": steady[1] * 1e3 if steady else None,
            "measured_steps": measured, "warmup_steps_excluded": self.warmup_steps,
            "wall_time_s": end - self.start,
        }
