"""dynamo-full's AdamW update (clipping, AdamW, the EMA) as one cached graph that writes nothing back.

Captured as torch.optim runs it (`optimizer.step()` inside the graph), the update changes its inputs in
place, and after every execution aot_autograd copies each changed input back into its tensor: one
host-side `copy_` per tensor per step, four per parameter (the weight, both moments, the step counter)
and one per gradient (clipping scales them in place). Each copy also leaves its tensor pending IR, which
the next `torch_xla.sync()` (the loader's) resolves tensor by tensor. On ViT-Tiny (152 parameters) that
was 15 ms of copies and 7-12 ms of that sync per step, about 40% of the host's work in a step.

Here the graph takes the tensors and returns new ones; it changes no input (the EMA's averages too are
new tensors). It is traced once on the XLA device and then launched as its compiled graph (cached_graph.py:
dynamo's and aot_autograd's tracing of it, most of its first call on ViT-Tiny (25 s, now 5.5 s), is not
needed for a function of tensors). The host then points each tensor at its new buffer (`tensor.data =
new`: no copy, no IR), so the parameters, the optimizer's state and anything holding them (checkpoints,
`StepPath.state()`) keep their identity. The arithmetic is torch's: its functional `adam` on copies
made inside the graph, with the group's settings, the gradients clipped as `clip_grad_norm` does
(tests/training/test_captured_update.py compares the weights with torch.optim.AdamW's).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import torch
from torch.optim.adam import adam

from neuron_train.training.optim import norm_and_clip_scale

if TYPE_CHECKING:
    from neuron_train.training.cached_graph import Fn  # CachedGraph's function and call
    from neuron_train.training.ema import ModelEma

# The group's settings the graph bakes in (every one _new_state reads but the LR, a device tensor input).
BAKED = ("betas", "eps", "weight_decay", "maximize", "capturable", "differentiable", "decoupled_weight_decay")


class CapturedAdamW:
    """`update()` of a captured step with torch's AdamW (capturable, a device LR): returns the gradient
    norm before clipping (0 without clipping) and drops the gradients, as `zero_grad` would. `capture`
    makes the graph from its function (cached_graph.CachedGraph; tests run the function directly)."""

    def __init__(self, optimizer: torch.optim.AdamW, clip: float, ema: ModelEma | None,
                 capture: Callable[[Fn], Fn]) -> None:
        if any(g["amsgrad"] or g["fused"] for g in optimizer.param_groups):
            raise ValueError("the captured update takes AdamW without amsgrad and fused")
        self.optimizer, self.clip, self.ema = optimizer, clip, ema
        self._graph = capture(self._new_state)

    def __call__(self) -> torch.Tensor:
        groups = self.optimizer.param_groups
        params = [[p for p in g["params"] if p.grad is not None] for g in groups]
        flat = [p for ps in params for p in ps]
        states = [self._state(p) for p in flat]
        ema_pos: tuple[int, ...] = ()  # where each EMA tensor is among the updated weights (-1: a buffer)
        ema_inputs: list[torch.Tensor] = []
        if self.ema is not None:
            where = {id(p): k for k, p in enumerate(flat)}
            ema_pos = tuple(where.get(id(m), -1) for m in self.ema.model_tensors())
            ema_inputs = self.ema.step_inputs([k >= 0 for k in ema_pos])
        # The graph's key: what it bakes in (cached_graph.py); which tensors come in fixes their shapes.
        key = (tuple(map(len, params)), tuple(map(id, flat)), ema_pos, self.clip,
               tuple(tuple(g[name] for name in BAKED) for g in groups))
        n = len(flat)
        olds = [*flat, *(s[name] for name in ("exp_avg", "exp_avg_sq", "step") for s in states)]
        new = self._graph(key, [*olds[:n], *(p.grad for p in flat), *olds[n:], *(g["lr"] for g in groups),
                                *ema_inputs])
        for o, t in zip(olds, new[:4 * n], strict=True):
            o.data = t  # this tensor is now the graph's output buffer: no copy, no pending IR
        if self.ema is not None:
            self.ema.assign(new[4 * n + 1:])
            # Integer buffers (BatchNorm's counts) are copied in place, traced: the loader's next sync
            # computes them with the model's own buffer updates (the graph changes no input).
            self.ema.copy_buffers()
        for p in flat:
            p.grad = None
        return new[4 * n]

    def _state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """AdamW's state of `p`, made as torch's capturable AdamW makes it, but uploaded (no graph)."""
        state = self.optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32).to(p.device)
            state["exp_avg"] = torch.zeros(p.shape, dtype=p.dtype).to(p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=p.dtype).to(p.device)
        return state

    def _new_state(self, key: Hashable, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The graph's function: new weights, moments and step counters (copies updated in the graph),
        the norm, then the EMA's new averages and buffers (following the new weights)."""
        counts, _, ema_pos = key[:3]  # type: ignore[index]
        n, groups = sum(counts), self.optimizer.param_groups
        params, grads, exp_avgs, exp_avg_sqs, steps = (inputs[k * n:(k + 1) * n] for k in range(5))  # __call__'s order
        lrs = inputs[5 * n:5 * n + len(groups)]
        if self.clip:  # clip_grad_norm's arithmetic (optim.py), the gradients scaled into new tensors
            norm, scale = norm_and_clip_scale(grads, self.clip)
            grads = list(torch._foreach_mul(grads, scale))
        else:
            norm = torch.zeros((), device=grads[0].device)
        new = [[t.clone() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs, steps)]
        # torch's per-tensor AdamW: its multi-tensor form refuses XLA tensors with capturable=True outside
        # torch.compile (an assertion), and traced lazily both are the same per-tensor ops on the device.
        start = 0
        for lr, count, group in zip(lrs, counts, groups, strict=True):
            beta1, beta2 = group["betas"]
            part = slice(start, start + count)
            start += count
            adam(new[0][part], grads[part], new[1][part], new[2][part], [], new[3][part], amsgrad=False,
                 has_complex=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=group["weight_decay"],
                 eps=group["eps"], maximize=group["maximize"], foreach=False,
                 capturable=group["capturable"], differentiable=group["differentiable"], fused=None,
                 decoupled_weight_decay=group["decoupled_weight_decay"])
        averages: list[torch.Tensor] = []
        if self.ema is not None:
            weights = [new[0][k] if k >= 0 else None for k in ema_pos]
            averages = self.ema.averaged(inputs[5 * n + len(groups):], weights)
        return [*new[0], *new[1], *new[2], *new[3], norm, *averages]
