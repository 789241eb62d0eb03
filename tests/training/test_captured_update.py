"""The captured AdamW update (training/captured_update.py) against torch.optim.AdamW and
torch.nn.utils.clip_grad_norm_ run on copies of the same weights and gradients.

Its function runs here uncaptured on CPU tensors (`capture` is the identity; torch's AdamW with a float
LR): the arithmetic and the write-back are what is compared. Captured on the XLA device it is the CPU
default's update, held to torch's weights by tests/training/test_train.py (every step path trains the same
weights) and to no copy-back by tests/training/test_step_launches.py."""

from __future__ import annotations

import pytest
import torch

from neuron_train.training.captured_update import CapturedAdamW


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def _adamw(model: torch.nn.Module, foreach: bool) -> torch.optim.AdamW:
    groups = [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.05},
              {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-2, foreach=foreach)


def _backward(model: torch.nn.Module, i: int) -> None:
    gen = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 6, generator=gen) * (1 + i), torch.randint(0, 3, (8,), generator=gen)
    torch.nn.functional.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("clip", [0.0, 0.05, 100.0])  # off; on every step; never reached
def test_the_update_gives_torch_adamw_weights_state_and_norms(foreach, clip):
    ref, ours = _model(), _model()
    ref_opt, opt = _adamw(ref, foreach), _adamw(ours, foreach)
    update = CapturedAdamW(opt, clip, None, capture=lambda fn: fn)
    params, ref_norms, norms = list(ours.parameters()), [], []
    for i in range(5):
        _backward(ref, i)
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), clip)) if clip else 0.0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        _backward(ours, i)
        norms.append(float(update()))
        assert all(p.grad is None for p in params)  # dropped, as zero_grad(set_to_none=True) would
    assert list(ours.parameters()) == params  # the same tensors, written through `.data`
    for p, r in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    if clip == 0.05:  # the clip took effect: the comparison above is not of two unclipped runs
        assert all(n > clip for n in ref_norms)
    ref_state, state = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    assert ref_state.keys() == state.keys()
    for k in ref_state:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[k][name], ref_state[k][name], rtol=1e-5, atol=1e-7)


def test_a_checkpointed_state_continues_under_torch_adamw():
    """Its state is torch's AdamW state: saved after our steps, torch's own optimizer goes on from it."""
    ref, ours = _model(), _model()
    ref_opt, opt = _adamw(ref, True), _adamw(ours, True)
    update = CapturedAdamW(opt, 0.0, None, capture=lambda fn: fn)
    for i in range(3):
        _backward(ref, i)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        _backward(ours, i)
        update()
    resumed = _adamw(ours, True)
    resumed.load_state_dict(opt.state_dict())
    for i in range(3, 5):
        for model, optimizer in ((ref, ref_opt), (ours, resumed)):
            _backward(model, i)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for p, r in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_amsgrad_is_refused_by_name():
    opt = torch.optim.AdamW(_model().parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        CapturedAdamW(opt, 0.0, None, capture=lambda fn: fn)
