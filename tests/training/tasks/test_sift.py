"""Loss-based sifting: the selection rules, fixed sub-batch shapes, flat compiles, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from neuron_train.common.errors import UsageError
from neuron_train.training.config import SiftConfig
from neuron_train.training.config_io import build_config
from neuron_train.training.tasks.sift import (
    LossHistory,
    SiftingTask,
    keep_probabilities,
    kept_per_batch,
    percentiles,
    push_history,
    topk_select,
    weighted_draw,
)
from tests.conftest import cpu_env, run_train, summary_of


def test_topk_keeps_exactly_the_highest_losses():
    scores = torch.tensor([0.1, 2.0, 0.5, 3.0, 0.2, 1.0])
    assert sorted(topk_select(scores, 3).tolist()) == [1, 3, 5]


def test_history_is_a_fixed_length_window_of_the_newest_losses():
    history, filled = torch.zeros(5), torch.tensor(0)
    history, filled = push_history(history, filled, torch.tensor([1.0, 2.0, 3.0]))
    assert filled.item() == 3 and history[-3:].tolist() == [1.0, 2.0, 3.0]
    history, filled = push_history(history, filled, torch.tensor([4.0, 5.0, 6.0]))
    assert filled.item() == 5 and history.tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]


def test_percentiles_count_only_valid_history_and_split_ties():
    history = torch.tensor([0.0, 0.0, 1.0, 2.0, 3.0, 4.0])  # the first two are not filled yet
    pct = percentiles(torch.tensor([0.5, 2.0, 9.0]), history, torch.tensor(4))
    # 0.5: none of {1,2,3,4} below; 2.0: one below, one tie -> 1.5 / 4; 9.0: all below.
    assert pct.tolist() == pytest.approx([0.0, 0.375, 1.0])


@pytest.mark.parametrize("beta,kept", [(0.5, 0.6667), (1.0, 0.5), (2.0, 0.3333), (3.0, 0.25)])
def test_relative_rule_keeps_the_expected_fraction(beta, kept):
    """Per sample, the rule keeps p ** beta; over a stream that averages 1 / (1 + beta) (the
    table in SageMaker's smart sifting reference), which is the fixed sub-batch size we train on."""
    g = torch.Generator().manual_seed(0)
    hist = LossHistory.empty(256, torch.device("cpu"))
    fractions = []
    for _ in range(200):
        losses = torch.empty(32).exponential_(generator=g)
        hist.push(losses)
        pct = percentiles(losses, hist.history, hist.filled)
        fractions.append(torch.bernoulli(keep_probabilities(pct, beta), generator=g).mean().item())
    assert sum(fractions[20:]) / len(fractions[20:]) == pytest.approx(kept, abs=0.02)
    assert kept_per_batch(SiftConfig(sift="relative", sift_beta=beta), 300) == round(300 * kept)


def test_weighted_draw_is_sampling_without_replacement_in_proportion_to_probability():
    torch.manual_seed(0)
    probs = torch.tensor([0.0, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0])
    draws = 4000
    ours, reference = torch.zeros(8), torch.zeros(8)
    for _ in range(draws):
        idx = weighted_draw(probs, 3)
        assert len(set(idx.tolist())) == 3
        ours[idx.long()] += 1
        reference[torch.multinomial(probs + 1e-6, 3, replacement=False)] += 1
    ours, reference = ours / draws, reference / draws
    assert (ours - reference).abs().max().item() < 0.04, (ours, reference)
    assert ours[0] < 0.01 and ours[-1] > 0.6                       # a zero-probability sample stays out
    assert torch.all(ours[1:] >= ours[:-1] - 0.02)                 # more likely with a higher loss


def test_kept_count_bad_values_are_usage_errors():
    with pytest.raises(UsageError, match="keeps 0 of a batch of 32"):
        kept_per_batch(SiftConfig(sift="relative", sift_beta=100.0), 32)
    with pytest.raises(UsageError, match="--sift-keep must be in"):
        build_config(overrides={"sift.sift": "topk", "sift.sift_keep": 1.5})
    with pytest.raises(UsageError, match="keeps no sample"):
        build_config(overrides={"sift.sift": "topk", "sift.sift_keep": 0.01})


class _Recorder:
    """A task that records the batch sizes it trains and scores on."""

    def __init__(self):
        self.trained, self.scored = [], []

    def per_sample(self, images, labels):
        (self.scored if not torch.is_grad_enabled() else self.trained).append(images.shape[0])
        return {"loss": images.flatten(1).sum(1) * labels.float()}

    def __call__(self, images, labels):
        self.trained.append(images.shape[0])
        return {"loss": images.sum()}

    def info(self):
        return {}


@pytest.mark.parametrize("mode", ["topk", "relative"])
def test_sub_batch_shape_is_fixed_after_the_delay_and_counts_add_up(mode):
    inner, pos, phases = _Recorder(), {"step": 0}, []
    cfg = SiftConfig(sift=mode, sift_keep=0.25, sift_beta=3.0, sift_history=64, sift_delay=2)
    task = SiftingTask(inner, cfg, batch_size=16, grad_accum=1, step=lambda: pos["step"],
                       mark_phase=phases.append, device=torch.device("cpu"))
    for step in range(6):
        pos["step"] = step
        images = torch.randn(16, 3, 4, 4, requires_grad=True)
        task(images, torch.arange(16) % 10)
    pos["step"] = 6  # where the loop stands after six steps, when it writes the summary
    assert inner.trained == [16, 16, 4, 4, 4, 4]   # full batches during the delay, then k=4 always
    assert inner.scored == [16, 16, 16, 16]
    assert phases == [SiftingTask.SWITCH_PHASE]  # the graph watch hears of the switch, once
    info = task.info()
    assert info["samples_scored_per_rank"] == 96 and info["samples_backpropagated_per_rank"] == 48


def test_graph_extraction_reaches_the_sifted_graph_within_its_few_steps(monkeypatch):
    """neuron_parallel_compile runs ~4 steps: a long delay would leave the sifted graph uncompiled."""
    monkeypatch.setenv("NEURON_EXTRACT_GRAPHS_ONLY", "1")
    inner, pos = _Recorder(), {"step": 0}
    task = SiftingTask(inner, SiftConfig(sift="topk", sift_keep=0.25, sift_delay=500), batch_size=16,
                       grad_accum=1, step=lambda: pos["step"], mark_phase=print,
                       device=torch.device("cpu"))
    for step in range(4):
        pos["step"] = step
        task(torch.randn(16, 3, 4, 4, requires_grad=True), torch.arange(16) % 10)
    assert inner.trained == [16, 16, 4, 4]


def test_topk_trains_on_the_selected_samples():
    trained_labels = []

    class Spy(_Recorder):
        def __call__(self, images, labels):
            trained_labels.append(sorted(labels.tolist()))
            return {}

    task = SiftingTask(Spy(), SiftConfig(sift="topk", sift_keep=0.5), batch_size=4, grad_accum=1,
                       step=lambda: 0, mark_phase=print, device=torch.device("cpu"))
    task(torch.ones(4, 1, 1, 1), torch.tensor([3, 9, 1, 7]))  # the recorder's loss is the label
    assert trained_labels == [[7, 9]]


@pytest.mark.slow
def test_step_number_does_not_make_torch_compile_recompile_every_step(tmp_path):
    """--step-compiler dynamo compiles the task: the step number it reads must not become a guard
    (it did before `sifting_now` was kept out of the trace: one dynamo recompile per step)."""
    proc = run_train(tmp_path / "dynamo", "--step-compiler", "dynamo", "--sift", "topk", "--sift-delay", "2",
                     "--max-steps", "8", "--batch-size", "16", "--eval-every", "100",
                     env=cpu_env(TORCH_LOGS="recompiles"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    recompiles = proc.stderr.count("Recompiling function")
    assert recompiles == 1, proc.stderr[-3000:]  # the switch from full to sifted batches, once


def _graphs(out) -> dict:
    return json.loads((out / "graphs.json").read_text())


def _train_graph_steps(graphs: dict, phase: str = "train") -> list[int]:
    """The steps at which `phase` compiled graphs (the default dynamo-full path compiles several per step)."""
    return sorted({g["step"] for g in graphs["graphs"] if g["phase"] == phase})


@pytest.mark.slow
def test_sifted_xla_run_compiles_one_extra_graph_at_the_switch_and_none_after(tmp_path):
    out = tmp_path / "topk"
    # --check-graphs: the run itself fails at a recompilation after the warm-up.
    proc = run_train(out, "--sift", "topk", "--sift-keep", "0.5", "--sift-delay", "3", "--check-graphs",
                     "--max-steps", "10", "--batch-size", "16", "--log-every", "1", "--eval-every", "100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    graphs = _graphs(out)
    assert _train_graph_steps(graphs) == [0]                          # the full batch's graphs, at the first step
    assert _train_graph_steps(graphs, SiftingTask.SWITCH_PHASE) == [3]  # the sifted step, once
    assert graphs["recompiles"] == [] and graphs["stable"], graphs["problems"]
    s = summary_of(out)
    assert s["samples_backpropagated_per_rank"] == 3 * 16 + 7 * 8
    assert s["samples_scored_per_rank"] == 10 * 16 and s["sift_kept_per_batch"] == 8


@pytest.mark.slow
def test_relative_sifting_end_to_end(tmp_path):
    out = tmp_path / "relative"
    proc = run_train(out, "--sift", "relative", "--sift-beta", "1", "--sift-history", "64",
                     "--max-steps", "8", "--batch-size", "16", "--log-every", "1", "--eval-every", "100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    graphs = _graphs(out)
    assert _train_graph_steps(graphs) == [0] and graphs["stable"], graphs  # as many as unsifted
    s = summary_of(out)
    assert s["backprop_fraction"] == 0.5 and s["sift"] == "relative"
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    assert len(losses) == 8 and all(math.isfinite(loss) for loss in losses)


@pytest.mark.slow
@pytest.mark.parametrize("args,needle", [
    (["--sift", "topk", "--sift-keep", "1.5"], "--sift-keep must be in (0, 1]"),
    (["--sift", "relative", "--sift-beta", "100", "--max-steps", "2"], "keeps 0 of a batch of 32"),
])
def test_bad_sift_flags_exit_2_with_one_line(tmp_path, args, needle):
    proc = run_train(tmp_path / "bad", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
