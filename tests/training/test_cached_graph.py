"""A function traced once and run as its compiled graph (training/cached_graph.py), on the CPU XLA device.
As dynamo-full's AdamW update: tests/training/test_step_launches.py, test_train.py (the same weights)."""

from __future__ import annotations

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

from neuron_train.training.cached_graph import SYNC_COUNTER, CachedGraph


def _up(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).to(torch_xla.device())  # device data: an upload, no graph


def _compiles() -> int:
    return met.counter_value("UncachedCompile") or 0


def _scaled_sum(key, xs):
    x, y = xs
    return [x * key + y, (x - y).sum()]


def test_one_graph_runs_each_call_on_that_calls_inputs():
    graph, before = CachedGraph(_scaled_sum), _compiles()
    for k in range(4):
        x, y = _up([k, 2.0 * k, 1.0]), _up([1.0, 1.0, -1.0])
        out = graph(2.5, [x, y])
        assert out[0].cpu().tolist() == pytest.approx([2.5 * k + 1, 5.0 * k + 1, 1.5])
        assert out[1].cpu().item() == pytest.approx(3 * k)
    assert _compiles() - before == 1


def test_a_new_key_is_a_new_graph_with_what_it_bakes_in():
    graph, before = CachedGraph(_scaled_sum), _compiles()
    xs = [_up([1.0, 2.0]), _up([0.0, 0.0])]
    assert graph(3.0, xs)[0].cpu().tolist() == [3.0, 6.0]
    assert graph(-1.0, xs)[0].cpu().tolist() == [-1.0, -2.0]
    assert graph(3.0, xs)[0].cpu().tolist() == [3.0, 6.0]
    assert _compiles() - before == 2


def test_an_input_still_pending_is_computed_first_and_counted():
    graph = CachedGraph(_scaled_sum)
    x = _up([1.0, 2.0])
    graph(1.0, [x, _up([0.0, 0.0])])
    waits = met.counter_value(SYNC_COUNTER) or 0
    summed = x + x  # pending IR, as gradients summed over micro-batches are
    assert graph(1.0, [summed, _up([1.0, 1.0])])[0].cpu().tolist() == [3.0, 5.0]
    assert (met.counter_value(SYNC_COUNTER) or 0) - waits == 1


def _writes_its_input(key, xs):
    xs[0].mul_(2)
    return [xs[0] + 1]


def _returns_its_input(key, xs):
    return [xs[0] * 2, xs[1]]


def _draws(key, xs):
    return [xs[0] + torch.rand(xs[0].shape, device=xs[0].device)]


@pytest.mark.parametrize(("fn", "message"), [
    (_writes_its_input, "changed its input 0 in place"),
    (_returns_its_input, "returned an input or one tensor twice"),
    (_draws, "draws random numbers"),
])
def test_a_function_the_graph_cannot_stand_for_is_refused(fn, message):
    with pytest.raises(ValueError, match=message):
        CachedGraph(fn)(0, [_up([1.0, 2.0]), _up([3.0, 4.0])])
