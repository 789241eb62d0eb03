"""Optimizer, gradient clipping and learning-rate schedule.

The LR is a pure function of the step, handed to the optimizer as a Python float each step: torch_xla
uploads a Python scalar as data, so a changing LR does not recompile. Except two values: XLA bakes
0 and 1 into the graph as constants (and AdamW turns LR 0 into a `mul(1.0)`), so a warm-up from 0
would compile extra graphs. The schedule never hands out exactly 0 or 1 (see `xla_safe`).

When dynamo captures the update (`--step-compiler dynamo-full`) a Python float would be a guard
(one graph per LR value), so the LR is a device tensor whose value is replaced every step, and
AdamW is `capturable` (its step counters live on the device too).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from neuron_train.training.config import OptimConfig

if TYPE_CHECKING:
    from neuron_train.training.device import Backend

_TINY = 1e-12  # stands in for LR 0: no visible update, and 1 - lr*wd stays != 1.0 in float64


def xla_safe(lr: float) -> float:
    if lr <= 0.0:
        return _TINY
    if lr == 1.0:
        return math.nextafter(1.0, 0.0)
    return lr


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based): linear warm-up, then cosine/linear/constant decay."""
    if step < cfg.warmup_steps:
        return xla_safe(cfg.lr * (step + 1) / (cfg.warmup_steps + 1))
    if cfg.schedule == "constant":
        return xla_safe(cfg.lr)
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0 - progress
    return xla_safe(cfg.min_lr + (cfg.lr - cfg.min_lr) * factor)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            # a host->device copy into the same tensor: new data, the captured graph is unchanged
            group["lr"].copy_(torch.tensor(lr, dtype=group["lr"].dtype))
        else:
            group["lr"] = lr


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, *, foreach: bool) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most `max_norm`; returns the norm before.

    foreach: two multi-tensor ops to trace instead of two per tensor (torch_xla's patched
    `clip_grad_norm_` refuses foreach=True); the same arithmetic as that function."""
    if not foreach:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    total, scale = norm_and_clip_scale(grads, max_norm)
    torch._foreach_mul_(grads, scale)
    return total


def norm_and_clip_scale(grads: list[torch.Tensor], max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients' global L2 norm and the factor (at most 1) that brings it to `max_norm`."""
    total = torch.linalg.vector_norm(torch.stack(list(torch._foreach_norm(grads))))
    return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """`load_state_dict`, keeping this run's update implementation (a checkpoint of another step path).

    torch restores the saved groups' LR and flags (foreach, capturable): keep ours instead (the LR is
    set from the schedule every step anyway), and put AdamW's step counters where ours keep them:
    on the device when capturable, else on the host (where reading them is no device sync)."""
    own = [{k: g[k] for k in _IMPLEMENTATION if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, keep in zip(optimizer.param_groups, own, strict=True):
        group.update(keep)
        for p in group["params"]:
            counters = optimizer.state.get(p, {})
            if isinstance(counters.get("step"), torch.Tensor):
                where = p.device if group.get("capturable") else torch.device("cpu")
                counters["step"] = counters["step"].to(where, torch.float32)


_IMPLEMENTATION = ("lr", "foreach", "capturable", "fused", "differentiable")


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, backend: Backend | None = None, *,
                    captured: bool = False) -> torch.optim.Optimizer:
    """The optimizer; with `cfg.zero1` a ZeRO-1 one sharded over `backend`'s ranks (zero1.py).

    `captured`: the update runs inside a dynamo graph (device LR tensor, capturable AdamW)."""
    # No weight decay on biases and norm scales (1-D parameters), as timm does.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    sgd = cfg.optimizer == "sgd"
    if cfg.zero1:
        if backend is None:
            raise ValueError("a ZeRO-1 optimizer needs the backend: its shards follow the ranks")
        from neuron_train.training.zero1 import build_zero1

        cls = torch.optim.SGD if sgd else torch.optim.AdamW
        defaults = {"lr": cfg.lr, "momentum": cfg.momentum} if sgd else {"lr": cfg.lr}
        return build_zero1(groups, cls, defaults, max_norm=cfg.grad_clip, backend=backend)
    if cfg.optimizer_impl == "flat":  # concatenated buckets: the fewest ops to trace (flat_optim.py)
        from neuron_train.training.flat_optim import FlatAdamW, FlatSGD

        if sgd:
            return FlatSGD(groups, lr=cfg.lr, momentum=cfg.momentum)
        return FlatAdamW(groups, lr=cfg.lr)
    # torch picks the per-tensor loop for XLA tensors by itself; foreach traces one op per group.
    foreach = cfg.optimizer_impl == "foreach"
    lr: float | torch.Tensor = torch.tensor(cfg.lr, device=decay[0].device) if captured else cfg.lr
    if sgd:
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, foreach=foreach)
    return torch.optim.AdamW(groups, lr=lr, foreach=foreach, capturable=captured)
