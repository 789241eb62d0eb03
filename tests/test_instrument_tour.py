"""The default precompile tour reaches the code that runs once per epoch (instrument/epochs.py):
a script that trains an epoch and then evaluates is precompiled, then fully covered under
--require-precompiled; with a --steps that stops before the epoch's end it is not."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, cpu_env

from neuron_train.instrument.epochs import MAX_EPOCH_STEPS, Epochs
from neuron_train.instrument.steps import Sites, StepWindow

EPOCH_EVAL = ROOT / "tests" / "fixtures" / "instrument" / "epoch_eval.py"


def add(sites: Sites, site: str, compiled: int = 0) -> None:
    sites.add(StepWindow(sites.count + 1, float(sites.count), site, compiled))


def test_the_epoch_tour_waits_for_the_next_epoch_after_the_evaluation():
    sites = Sites()
    add(sites, "train", 1)
    for _ in range(6):
        add(sites, "train")
    assert sites.stop_reason("tour", 5) == "tour"           # the warm-sites rule would stop here ...
    assert sites.stop_reason("tour", 5, to_epoch_end=True) is None   # ... before the epoch's end
    add(sites, "eval", 1)
    add(sites, "eval", 1)                                   # the evaluation, never warm: it ran once
    sites.epoch_began()
    add(sites, "train")
    assert sites.stop_reason("tour", 5, to_epoch_end=True) is None   # one step into the next epoch
    add(sites, "train")
    assert sites.stop_reason("tour", 5, to_epoch_end=True) == "tour"


def test_a_site_that_compiles_in_the_next_epoch_holds_the_tour_until_warm():
    sites = Sites()
    for n in range(4):
        add(sites, "train", int(n == 0))
    sites.epoch_began()
    add(sites, "train", 1)
    add(sites, "train")
    assert sites.stop_reason("tour", 1, to_epoch_end=True) is None
    add(sites, "train")
    assert sites.stop_reason("tour", 1, to_epoch_end=True) == "tour"


def test_the_tour_says_at_its_first_step_whether_it_reaches_the_epochs_end():
    epochs = Epochs(lambda: None)
    reaches, words = epochs.plan(5)
    assert not reaches and "no DataLoader of known length" in words and "--steps 0" in words
    epochs.feeding = MAX_EPOCH_STEPS + 1
    reaches, words = epochs.plan(5)
    assert not reaches and f"--steps {MAX_EPOCH_STEPS + 6} or more" in words
    epochs.feeding = 12
    reaches, words = epochs.plan(5)
    assert reaches and "end of the first epoch (12 steps)" in words


def run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "neuron_train", *args], env=cpu_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_precompile_by_default_then_require_precompiled_covers_the_evaluation(tmp_path):
    script = ["--", sys.executable, str(EPOCH_EVAL)]
    tour = run(tmp_path, "precompile", "--compile-cache", "cc", *script)
    assert tour.returncode == 0, tour.stdout + tour.stderr
    assert "the tour runs to the end of the first epoch (12 steps)" in tour.stdout  # the command's output
    assert "past the first epoch's end" in tour.stdout
    real = run(tmp_path, "check-graphs", "--compile-cache", "cc", "--require-precompiled", *script)
    assert real.returncode == 0, real.stdout + real.stderr
    assert "precompile coverage 100% (3/3 graphs" in real.stdout
    assert "epoch 1: accuracy" in real.stdout  # ran whole, not stopped
    # The same with the warm-sites rule alone (a tour of 5 steps): the evaluation is missed.
    short = run(tmp_path, "precompile", "--compile-cache", "cc5", "--steps", "5", *script)
    assert short.returncode == 0, short.stdout + short.stderr
    stopped = run(tmp_path, "check-graphs", "--compile-cache", "cc5", "--require-precompiled", *script)
    assert stopped.returncode == 1 and "--require-precompiled stopped" in stopped.stdout
