"""`--optimizer-impl flat`: AdamW and SGD over concatenated parameters, the fewest ops to trace.

Why: on the lazy step path (Neuron's default) Python traces every op of the update into torch_xla's
IR each step, while the device runs the previous one. torch's per-tensor AdamW traces about a dozen
ops per weight tensor (ViT-B/16 has 152) plus two for clipping; its multi-tensor form traces the
same ops through C++ loops. Here the weights and gradients of a bucket (one parameter group and
dtype, at most BUCKET_ELEMENTS and BUCKET_TENSORS) are concatenated once, clipped and updated with a
dozen ops in all, and split back: a few cheap ops per tensor (its views, a split, a copy).
scripts/bench_trace.py measures the difference (docs/measurements.md).

The arithmetic is torch's single-tensor AdamW / SGD element by element (tests/training/test_flat_optim.py
holds the weights to torch's), with the step counter on the host as torch keeps it (its bias
corrections are Python floats, uploaded as data: no recompilation as they change).
`state_dict()` is torch's per-parameter layout, so a checkpoint resumes under any implementation.
Gradient clipping is part of the update (`clip_and_step`): the global norm of the flat gradients.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from neuron_train.common.errors import RunError

# A bucket's concatenated weights and gradients are transient copies in the step's graph: the element
# cap bounds that extra device memory (128 MB in fp32) for large models. The tensor cap bounds a
# concatenation's fan-in: XLA's CPU backend computes a fused concatenation's element by choosing among
# its operands, and 152 operands made ViT-Tiny's update execute about 2x slower than 16 did
# (docs/measurements.md); 16 still traces ~10x fewer ops than the per-tensor loop.
BUCKET_ELEMENTS = 1 << 25
BUCKET_TENSORS = 16


@dataclass
class _Bucket:
    """Consecutive parameters of one group and dtype; their state is one flat tensor per key."""

    group: dict[str, Any]
    params: list[torch.Tensor]
    state: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def sizes(self) -> list[int]:
        return [p.numel() for p in self.params]

    # A 1-D tensor (a bias, a norm's scale: most of a transformer's tensors) needs no view op to trace.
    def flat(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in tensors])

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [part if p.dim() == 1 else part.view_as(p)
                for part, p in zip(torch.split(flat, self.sizes), self.params, strict=True)]


class FlatOptimizer(torch.optim.Optimizer):
    """The bucketing, clipping and torch-compatible state_dict; subclasses give the update rule."""

    state_keys: tuple[str, ...] = ()

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self._buckets: list[_Bucket] = []
        self.steps = 0  # optimizer steps taken (torch keeps one per parameter; all are equal)

    # ----- the update --------------------------------------------------------------------------
    def _update(self, bucket: _Bucket, weights: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("the flat optimizer takes no closure")
        self.clip_and_step(0.0)

    @torch.no_grad()
    def clip_and_step(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to global L2 norm `max_norm` (0: no clipping), update; the norm before."""
        if not self._buckets:
            self._buckets = self._make_buckets(lambda p: p.grad is not None)
        grads = [b.flat(self._grads(b)) for b in self._buckets]
        if max_norm:
            # torch.nn.utils.clip_grad_norm_'s arithmetic: the norm of the per-tensor (here per-bucket) norms
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            grads = [g * scale for g in grads]
        else:  # no clipping: the norm is not computed (0, as the other implementations log it)
            norm = torch.zeros((), device=grads[0].device)
        self.steps += 1
        for bucket, g in zip(self._buckets, grads, strict=True):
            new = self._update(bucket, bucket.flat(bucket.params), g)
            torch._foreach_copy_(bucket.params, bucket.views(new))
        return norm

    @staticmethod
    def _grads(bucket: _Bucket) -> list[torch.Tensor]:
        grads = [p.grad for p in bucket.params]
        if any(g is None for g in grads):
            raise RunError("--optimizer-impl flat: a parameter that had a gradient at the first step has "
                           "none now (a branch the model takes only sometimes); use --optimizer-impl foreach")
        return [g for g in grads if g is not None]

    def _make_buckets(self, keep: Any) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        for group in self.param_groups:
            current: _Bucket | None = None
            for p in group["params"]:
                if not keep(p):
                    continue
                if (current is None or current.params[0].dtype != p.dtype
                        or sum(current.sizes) + p.numel() > BUCKET_ELEMENTS or len(current.params) >= BUCKET_TENSORS):
                    current = _Bucket(group, [])
                    buckets.append(current)
                current.params.append(p)
        return buckets

    def state_tensors(self) -> list[torch.Tensor]:
        """The flat state this optimizer holds on the device (for its memory figure)."""
        return [t for b in self._buckets for t in b.state.values()]

    # ----- torch's per-parameter layout, for checkpoints -----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's layout, on the host: each bucket's state crosses once and is split there (split on
        the device, every tensor would be a graph of its own to compile at the first checkpoint)."""
        self.state.clear()
        for bucket in self._buckets:
            for key, flat in bucket.state.items():
                host = flat.detach().cpu()  # host transfer of device data: the checkpoint's, made per bucket
                for p, view in zip(bucket.params, bucket.views(host), strict=True):
                    self.state[p][key] = view
            for p in bucket.params:
                self.state[p].update(self._counter())
        try:
            return super().state_dict()
        finally:
            self.state.clear()

    def _counter(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # per-parameter state, moved to each weight's device
        self._buckets = self._make_buckets(lambda p: p in self.state)
        for bucket in self._buckets:
            first = self.state[bucket.params[0]]
            self.steps = int(first["step"]) if "step" in first else self.steps
            for key in self.state_keys:
                if key in first:
                    bucket.state[key] = bucket.flat(self.state[p][key] for p in bucket.params)
        self.state.clear()


class FlatAdamW(FlatOptimizer):
    """torch.optim.AdamW (decoupled weight decay, no amsgrad), over flat buckets."""

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "amsgrad": False, "maximize": False})

    def _counter(self) -> dict[str, torch.Tensor]:
        return {"step": torch.tensor(float(self.steps))}  # torch's: a float32 host tensor

    def _update(self, bucket: _Bucket, weights: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        group, state = bucket.group, bucket.state
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        if not state:
            state["exp_avg"] = torch.zeros_like(weights)
            state["exp_avg_sq"] = torch.zeros_like(weights)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if group["weight_decay"] != 0:
            weights = weights * (1 - lr * group["weight_decay"])
        exp_avg.lerp_(grads, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grads, grads, value=1 - beta2)
        step = float(self.steps)  # on the host, as torch keeps it: Python floats, uploaded as data
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        return weights.addcdiv(exp_avg, denom, value=-lr / bias_correction1)


class FlatSGD(FlatOptimizer):
    """torch.optim.SGD (L2 weight decay, momentum without dampening or Nesterov), over flat buckets."""

    state_keys = ("momentum_buffer",)

    def __init__(self, params: Any, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "dampening": 0.0, "nesterov": False, "maximize": False})

    def _update(self, bucket: _Bucket, weights: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        group, state = bucket.group, bucket.state
        if group["weight_decay"] != 0:
            grads = grads.add(weights, alpha=group["weight_decay"])
        if group["momentum"] != 0:
            if "momentum_buffer" not in state:  # torch's first step: the buffer is the gradient
                state["momentum_buffer"] = grads.detach().clone()
            else:
                state["momentum_buffer"].mul_(group["momentum"]).add_(grads)
            grads = state["momentum_buffer"]
        return weights.add(grads, alpha=-group["lr"])
