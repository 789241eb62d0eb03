"""Optimizer and learning-rate schedule.

The LR is a pure function of the step, handed to the optimizer as a Python float each step: torch_xla
uploads a Python scalar as data, so a changing LR does not recompile. Except two values: XLA bakes
0 and 1 into the graph as constants (and AdamW turns LR 0 into a `mul(1.0)`), so a warm-up from 0
would compile extra graphs. The schedule never hands out exactly 0 or 1 (see `xla_safe`).
"""

from __future__ import annotations

import math

import torch

from neuron_train.training.config import OptimConfig

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
        group["lr"] = lr


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, backend=None) -> torch.optim.Optimizer:
    """The optimizer; with `cfg.zero1` a ZeRO-1 one sharded over `backend`'s ranks (zero1.py)."""
    # No weight decay on biases and norm scales (1-D parameters), as timm does.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "sgd":
        cls, defaults = torch.optim.SGD, {"lr": cfg.lr, "momentum": cfg.momentum}
    else:
        cls, defaults = torch.optim.AdamW, {"lr": cfg.lr}
    if cfg.zero1:
        if backend is None:
            raise ValueError("a ZeRO-1 optimizer needs the backend: its shards follow the ranks")
        from neuron_train.training.zero1 import build_zero1

        return build_zero1(groups, cls, defaults, max_norm=cfg.grad_clip, backend=backend)
    return cls(groups, **defaults)
