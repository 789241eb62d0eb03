"""--optimizer-impl flat (training/flat_optim.py): torch's AdamW/SGD arithmetic over concatenated buckets.

The expectations are torch's own optimizers and clip_grad_norm_ run on copies of the same weights and
gradients (CPU tensors: the arithmetic, not the device, is what is compared)."""

from __future__ import annotations

import pytest
import torch

from neuron_train.common.errors import RunError
from neuron_train.training import flat_optim
from neuron_train.training.flat_optim import FlatAdamW, FlatSGD


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def _groups(model: torch.nn.Module, wd: float) -> list[dict]:
    return [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": wd},
            {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0}]


def _train(model: torch.nn.Module, step, steps: int = 6, lrs=(3e-2, 2e-2, 1e-2, 5e-3, 5e-3, 1e-3)) -> None:
    torch.manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(8, 6) * (1 + i), torch.randint(0, 3, (8,))
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        step(lrs[i])


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("clip", [0.0, 0.05, 100.0])
def test_flat_adamw_gives_torch_adamw_weights_with_clipping(clip):
    ref, flat = _model(), _model()
    ref_opt = torch.optim.AdamW(_groups(ref, 0.05), lr=1e-2, foreach=False)
    flat_opt = FlatAdamW(_groups(flat, 0.05), lr=1e-2)
    norms = []

    def ref_step(lr):
        for g in ref_opt.param_groups:
            g["lr"] = lr
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), clip)) if clip else 0.0)
        ref_opt.step()

    def flat_step(lr):
        for g in flat_opt.param_groups:
            g["lr"] = lr
        norms.append(float(flat_opt.clip_and_step(clip)))

    _train(ref, ref_step)
    _train(flat, flat_step)
    for a, b in zip(_weights(ref), _weights(flat), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    half = len(norms) // 2
    torch.testing.assert_close(torch.tensor(norms[half:]), torch.tensor(norms[:half]), rtol=1e-5, atol=1e-6)
    if clip == 0.05:  # the clipping took effect: it is not a no-op that happens to agree
        assert all(n > clip for n in norms)


def test_flat_sgd_with_momentum_and_weight_decay_gives_torch_sgd_weights():
    ref, flat = _model(), _model()
    ref_opt = torch.optim.SGD(_groups(ref, 0.01), lr=0.1, momentum=0.9, foreach=False)
    flat_opt = FlatSGD(_groups(flat, 0.01), lr=0.1, momentum=0.9)
    _train(ref, lambda lr: ref_opt.step())
    _train(flat, lambda lr: flat_opt.step())
    for a, b in zip(_weights(ref), _weights(flat), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_a_flat_checkpoint_resumes_in_torch_adamw_and_back():
    """state_dict() is torch's per-parameter layout: resume across implementations, same weights."""
    ref, flat = _model(), _model()
    ref_opt = torch.optim.AdamW(_groups(ref, 0.05), lr=1e-2, foreach=False)
    flat_opt = FlatAdamW(_groups(flat, 0.05), lr=1e-2)
    _train(ref, lambda lr: ref_opt.step(), steps=3)
    _train(flat, lambda lr: flat_opt.step(), steps=3)
    saved = flat_opt.state_dict()
    assert set(saved["state"]) == set(range(len(list(flat.parameters()))))
    assert float(saved["state"][0]["step"]) == 3.0
    torch.testing.assert_close(saved["state"][0]["exp_avg"], ref_opt.state_dict()["state"][0]["exp_avg"])

    into_torch = torch.optim.AdamW(_groups(flat, 0.05), lr=1e-2, foreach=False)
    into_torch.load_state_dict(saved)
    into_flat = FlatAdamW(_groups(ref, 0.05), lr=1e-2)
    into_flat.load_state_dict(ref_opt.state_dict())
    _train(flat, lambda lr: into_torch.step(), steps=2)
    _train(ref, lambda lr: into_flat.step(), steps=2)
    for a, b in zip(_weights(ref), _weights(flat), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert into_flat.steps == 5


def test_buckets_are_capped_split_by_dtype_and_keep_order(monkeypatch):
    monkeypatch.setattr(flat_optim, "BUCKET_ELEMENTS", 40)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    model[2].to(torch.float64)  # elements: 30 + 5, 15 + 3 (35 + 15 > 40), then 6 + 2 in float64
    opt = FlatAdamW([{"params": list(model.parameters()), "weight_decay": 0.0}])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert [[p.numel() for p in b.params] for b in opt._buckets] == [[30, 5], [15, 3], [6, 2]]
    assert [b.state["exp_avg"].dtype for b in opt._buckets] == [torch.float32, torch.float32, torch.float64]
    assert sum(t.numel() for t in opt.state_tensors()) == 2 * 61
    monkeypatch.setattr(flat_optim, "BUCKET_ELEMENTS", 1000)
    monkeypatch.setattr(flat_optim, "BUCKET_TENSORS", 3)
    assert [[p.numel() for p in b.params] for b in opt._make_buckets(lambda p: True)] == [[30, 5, 15], [3], [6, 2]]


def test_flat_sgd_clips_as_torch_clip_grad_norm_does():
    """SGD, unlike Adam, is not invariant to the gradients' scale: any change of the clip factor shows."""
    for clip in (0.05, 100.0):
        ref, flat = _model(), _model()
        ref_opt = torch.optim.SGD(_groups(ref, 0.0), lr=0.1, foreach=False)
        flat_opt = FlatSGD(_groups(flat, 0.0), lr=0.1)

        def ref_step(lr, ref=ref, ref_opt=ref_opt, clip=clip):
            torch.nn.utils.clip_grad_norm_(list(ref.parameters()), clip)
            ref_opt.step()

        _train(ref, ref_step)
        _train(flat, lambda lr, flat_opt=flat_opt, clip=clip: flat_opt.clip_and_step(clip))
        for a, b in zip(_weights(ref), _weights(flat), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_a_parameter_that_loses_its_gradient_is_one_clear_error():
    model = _model()
    opt = FlatAdamW(_groups(model, 0.0))
    _train(model, lambda lr: opt.step(), steps=1)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(torch.randn(2, 6)), torch.tensor([0, 1])).backward()
    model[0].bias.grad = None
    with pytest.raises(RunError, match="--optimizer-impl foreach"):
        opt.step()
