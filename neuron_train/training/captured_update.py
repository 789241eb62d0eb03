"""dynamo-full's AdamW update (clipping, AdamW, the EMA) as one captured graph that writes nothing back.

Captured as torch.optim runs it (`optimizer.step()` inside the graph), the update changes its inputs in
place, and after every execution aot_autograd copies each changed input back into its tensor: one
host-side `copy_` per tensor per step, four per parameter (the weight, both moments, the step counter)
and one per gradient (clipping scales them in place). Each copy also leaves its tensor pending IR, which
the next `torch_xla.sync()` (the loader's) resolves tensor by tensor. On ViT-Tiny (152 parameters) that
was 15 ms of copies and 7-12 ms of that sync per step, about 40% of the host's work in a step.

Here the graph takes the tensors and returns new ones; it changes no input except the EMA's average.
The host then points each tensor at its new buffer (`tensor.data = new`: no copy, no IR), so the
parameters, the optimizer's state and anything holding them (checkpoints, `StepPath.state()`) keep
their identity. The arithmetic is torch's: its functional `adam` on copies made inside the graph, with
the group's settings, the gradients clipped as `clip_grad_norm` does (tests/training/test_captured_update.py
compares the weights with torch.optim.AdamW's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.adam import adam

from neuron_train.training.optim import norm_and_clip_scale

if TYPE_CHECKING:
    from neuron_train.training.ema import ModelEma

Lists = list[list[torch.Tensor]]  # per parameter group


class CapturedAdamW:
    """`update()` of a captured step with torch's AdamW (capturable, a device LR): returns the gradient
    norm before clipping (0 without clipping) and drops the gradients, as `zero_grad` would."""

    def __init__(self, optimizer: torch.optim.AdamW, clip: float, ema: ModelEma | None,
                 capture: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        if any(g["amsgrad"] or g["fused"] for g in optimizer.param_groups):
            raise ValueError("the captured update takes AdamW without amsgrad and fused")
        self.optimizer, self.clip, self.ema = optimizer, clip, ema
        self._graph = capture(self._new_state)

    def __call__(self) -> torch.Tensor:
        groups = self.optimizer.param_groups
        params = [[p for p in g["params"] if p.grad is not None] for g in groups]
        states = [[self._state(p) for p in ps] for ps in params]
        old = [[s["exp_avg"] for s in ss] for ss in states], [[s["exp_avg_sq"] for s in ss] for ss in states]
        steps = [[s["step"] for s in ss] for ss in states]
        grads = [[p.grad for p in ps if p.grad is not None] for ps in params]
        flat = [p for ps in params for p in ps]
        ema_pos: tuple[int, ...] = ()
        if self.ema is not None:  # where each EMA tensor is among the updated weights (-1: a buffer)
            where = {id(p): k for k, p in enumerate(flat)}
            ema_pos = tuple(where.get(id(m), -1) for m in self.ema.model_tensors())
        new, norm = self._graph(params, grads, old[0], old[1], steps, [g["lr"] for g in groups], ema_pos)
        for olds, news in zip((params, *old, steps), new, strict=True):
            for o_group, n_group in zip(olds, news, strict=True):
                for o, n in zip(o_group, n_group, strict=True):
                    o.data = n  # this tensor is now the graph's output buffer: no copy, no pending IR
        for p in flat:
            p.grad = None
        return norm

    def _state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """AdamW's state of `p`, made as torch's capturable AdamW makes it, but uploaded (no graph)."""
        state = self.optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32).to(p.device)
            state["exp_avg"] = torch.zeros(p.shape, dtype=p.dtype).to(p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=p.dtype).to(p.device)
        return state

    def _new_state(self, params: Lists, grads: Lists, exp_avgs: Lists, exp_avg_sqs: Lists, steps: Lists,
                   lrs: list[torch.Tensor], ema_pos: tuple[int, ...]) -> tuple[tuple[Lists, ...], torch.Tensor]:
        """The captured function: new weights, moments and step counters (copies updated in the graph),
        and the norm; the EMA's average follows the new weights (its lerp_ is the one input changed)."""
        all_grads = [g for gs in grads for g in gs]
        if self.clip:  # clip_grad_norm's arithmetic (optim.py), the gradients scaled into new tensors
            norm, scale = norm_and_clip_scale(all_grads, self.clip)
            grads = [list(torch._foreach_mul(gs, scale)) for gs in grads]
        else:
            norm = torch.zeros((), device=all_grads[0].device)
        new = tuple([[t.clone() for t in ts] for ts in lists] for lists in (params, exp_avgs, exp_avg_sqs, steps))
        for i, group in enumerate(self.optimizer.param_groups):
            beta1, beta2 = group["betas"]
            adam(new[0][i], grads[i], new[1][i], new[2][i], [], new[3][i], amsgrad=False, has_complex=False,
                 beta1=beta1, beta2=beta2, lr=lrs[i], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
                 differentiable=group["differentiable"], fused=None,
                 decoupled_weight_decay=group["decoupled_weight_decay"])
        if self.ema is not None:
            weights = [p for ps in new[0] for p in ps]
            self.ema.update([weights[k] if k >= 0 else m for k, m in zip(ema_pos, self.ema.model_tensors(),
                                                                            strict=True)])
        return new, norm
