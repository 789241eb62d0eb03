"""Guards of the training step's arithmetic that each killed a mutant which survived the rest of the
suite (issue 22; docs/measurements.md lists the mutant, the break and the test): the LR schedule's
0/1 guard through the real schedule (training/optim.py) and the gradient average of two gloo ranks
(training/device.py). Each fails with its guard removed. The guards of the checker and of the cache's
paths: tests/graphs/test_analyzer_guards.py, tests/precompile/test_cache_guards.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neuron_train.training.config import OptimConfig
from neuron_train.training.optim import lr_at


# ----- the LR schedule never hands out exactly 0 or 1 (M23, M24) ------------------------------------
@pytest.mark.parametrize("schedule, warmup", [("cosine", 0), ("linear", 0), ("constant", 0), ("cosine", 3)])
def test_the_schedule_from_and_to_the_special_values_never_hands_them_out(schedule, warmup):
    """Peak LR 1 and a decay to min LR 0 (values XLA bakes into the graph as constants): the real
    schedule reaches both ends of the range within a hair but never exactly 0 or 1."""
    cfg = OptimConfig(optimizer="sgd", lr=1.0, min_lr=0.0, schedule=schedule, warmup_steps=warmup)
    lrs = [lr_at(step, cfg, total_steps=10) for step in range(14)]
    assert all(0.0 < lr < 1.0 for lr in lrs), lrs
    assert max(lrs) == pytest.approx(1.0, abs=1e-12)
    if schedule != "constant":
        assert lrs[-1] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_the_schedule_warms_up_linearly_then_decays_to_min_lr(schedule):
    """Warm-up over 4 steps to peak 0.8: k/5 of it at step k-1; then the decay over the 8 steps left:
    a quarter of the way at step 6, half-way between peak and min at step 8, min from step 12 on."""
    cfg = OptimConfig(lr=0.8, min_lr=0.2, schedule=schedule, warmup_steps=4)
    assert [lr_at(k, cfg, total_steps=12) for k in range(4)] == pytest.approx([0.16, 0.32, 0.48, 0.64])
    assert lr_at(4, cfg, total_steps=12) == pytest.approx(0.8)
    if schedule == "constant":
        assert [lr_at(k, cfg, total_steps=12) for k in (8, 12, 30)] == pytest.approx([0.8] * 3)
        return
    assert lr_at(8, cfg, total_steps=12) == pytest.approx(0.5)
    quarter = 0.2 + 0.6 * (0.5 * (1 + math.cos(math.pi / 4)) if schedule == "cosine" else 0.75)
    assert lr_at(6, cfg, total_steps=12) == pytest.approx(quarter)
    assert [lr_at(k, cfg, total_steps=12) for k in (12, 30)] == pytest.approx([0.2, 0.2])
    # one step of decay: the step after the warm-up is already at min LR
    assert [lr_at(k, cfg, total_steps=5) for k in (4, 5)] == pytest.approx([0.8, 0.2])


# ----- gloo gradient averaging (M26) ------------------------------------------------------------------
def _average_rank(rank: int, world: int, port: int) -> list[float]:
    from neuron_train.training.device import _gloo_average

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        p = torch.nn.Parameter(torch.zeros(3))
        q = torch.nn.Parameter(torch.zeros(2))
        r = torch.nn.Parameter(torch.zeros(2, 2))  # three tensors: each must get its own slice back
        p.grad = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
        q.grad = torch.tensor([10.0, -4.0]) * (rank + 1)
        r.grad = torch.tensor([[5.0, 6.0], [7.0, 8.0]]) * (rank + 1)
        _gloo_average(torch.optim.SGD([p, q, r], lr=0.1), world, torch.device("cpu"))
        return torch.cat([p.grad, q.grad, r.grad.reshape(-1)]).tolist()
    finally:
        dist.destroy_process_group()


def _second_rank(port: int, out) -> None:
    out.put(_average_rank(1, 2, port))


@pytest.mark.slow  # a forked torch process is rank 1
def test_two_gloo_ranks_average_their_gradients_not_sum_them():
    """Ranks holding g and 2g both end with 1.5g: the mean (a sum would give 3g). This process is
    rank 0, a forked one rank 1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    other = ctx.Process(target=_second_rank, args=(port, out))
    other.start()
    mine = _average_rank(0, 2, port)
    theirs = out.get(timeout=120)
    other.join(timeout=60)
    expected = [1.5 * v for v in (1.0, 2.0, 3.0, 10.0, -4.0, 5.0, 6.0, 7.0, 8.0)]
    assert mine == theirs == pytest.approx(expected, abs=1e-6)
    assert not math.isclose(mine[0], 3.0)
