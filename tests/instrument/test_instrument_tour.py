"""The default precompile tour reaches the code that runs once per epoch (instrument/epochs.py):
a script that trains an epoch and then evaluates is precompiled, then fully covered under
--require-precompiled; with a --steps that stops before the epoch's end it is not."""

from __future__ import annotations

import subprocess
import sys

import pytest

from neuron_train.instrument.epochs import MAX_EPOCH_STEPS, Epochs
from neuron_train.instrument.probe import ProbeRecord, Stop
from neuron_train.instrument.steps import Sites, StepWindow
from neuron_train.precompile.script_precompile import tour_ended
from tests.conftest import ROOT, cpu_env

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


def test_a_tour_stopped_past_the_first_epoch_names_the_steps_that_reach_a_final_evaluation():
    """transformers' image-classification example evaluates once, after trainer.train(): a tour that
    stops in the second epoch never reaches it, and precompile says so with the --steps that do."""
    stop = Stop("tour", 30)
    epoch = ProbeRecord(1, "tour", 5, to_epoch_end=True, epoch_steps=12)
    words = tour_ended(stop, [epoch], 30)
    assert "past the first epoch's end (12 steps an epoch)" in words
    assert "after the last epoch" in words and "is not precompiled" in words
    assert "--steps 0 runs the command whole, or --steps 12 x epochs + 5 reaches it" in words
    warm = tour_ended(stop, [ProbeRecord(1, "tour", 5)], 30)
    assert "every call site it reached was warm" in warm and "--steps 0" in warm
    assert tour_ended(None, [epoch], 40) == \
        "the command ended by itself after 40 steps"


class Iterator:
    """Stands for a DataLoader iterator (weakly referenced, as the tour keeps them)."""


def test_fast_forward_ends_the_running_epoch_and_leaves_one_batch_to_each_later_one():
    """The loader that fed the steps: its running epoch's iterator gets no more batches, each later
    epoch's one (a per-epoch average never divides by zero); any other loader (an evaluation's) is
    left whole, and batches it feeds meanwhile do not make it the one cut."""
    epochs = Epochs(lambda: None)
    train, evaluation = [0] * 12, [0] * 4
    epochs.fed(train)
    epochs.fast_forward()
    running, later, other = Iterator(), Iterator(), Iterator()
    epochs.fed(evaluation)
    assert [epochs.take(train, running), epochs.take(train, running)] == [False, False]
    assert [epochs.take(train, later), epochs.take(train, later)] == [True, False]
    assert all(epochs.take(evaluation, other) for _ in range(5))
    assert all(Epochs(lambda: None).take(train, Iterator()) for _ in range(3))  # no fast-forward: nothing cut


def test_fast_forward_tells_a_trainer_to_stop_training_at_its_next_callback_event():
    from transformers import TrainerControl, TrainingArguments
    from transformers.trainer_callback import CallbackHandler, TrainerState

    handler = CallbackHandler([], None, None, None, None)
    args = TrainingArguments(output_dir="unused", report_to=[])
    call_event = CallbackHandler.call_event
    try:
        words = Epochs(lambda: None).fast_forward()
        control = handler.on_step_end(args, TrainerState(), TrainerControl())
    finally:
        CallbackHandler.call_event = call_event  # type: ignore[method-assign]
    assert "the Trainer told to stop training" in words
    assert control.should_training_stop and control.should_epoch_stop


def test_a_fast_forwarded_tour_says_where_it_fast_forwarded_and_whether_it_reached_the_end():
    forwarded = ProbeRecord(1, "tour", 5, to_epoch_end=True, epoch_steps=12, fast_forward=14)
    assert tour_ended(None, [forwarded], 16) == (
        "fast-forwarded after step 14 (every call site warm past the first epoch's end: the remaining epochs "
        "cut short), then the command ran to its end after 16 steps, the code after its training loop included")
    words = tour_ended(Stop("tour", 540), [forwarded], 540)
    assert words.startswith("fast-forwarded after step 14, but the command had not ended 526 steps later")
    assert "--steps 0 runs the command whole" in words


def run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "neuron_train", *args], env=cpu_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_precompile_by_default_then_require_precompiled_covers_the_evaluation(tmp_path):
    script = ["--", sys.executable, str(EPOCH_EVAL)]
    tour = run(tmp_path, "precompile", "--compile-cache", "cc", *script)
    assert tour.returncode == 0, tour.stdout + tour.stderr
    assert "the tour runs to the end of the first epoch (12 steps)" in tour.stdout  # the command's output
    assert "fast-forwarded after step" in tour.stdout and "epoch 1: accuracy" in tour.stdout  # reached the end
    real = run(tmp_path, "check-graphs", "--compile-cache", "cc", "--require-precompiled", *script)
    assert real.returncode == 0, real.stdout + real.stderr
    assert "precompile coverage 100% (3/3 graphs" in real.stdout
    assert "epoch 1: accuracy" in real.stdout  # ran whole, not stopped
    # The same with the warm-sites rule alone (a tour of 5 steps): the evaluation is missed.
    short = run(tmp_path, "precompile", "--compile-cache", "cc5", "--steps", "5", *script)
    assert short.returncode == 0, short.stdout + short.stderr
    stopped = run(tmp_path, "check-graphs", "--compile-cache", "cc5", "--require-precompiled", *script)
    assert stopped.returncode == 1 and "--require-precompiled stopped" in stopped.stdout
