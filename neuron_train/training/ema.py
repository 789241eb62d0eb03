"""The model EMA (--model-ema): timm's ModelEmaV3, made on the host and updated in the step's graph.

timm's ModelEmaV3 is used as it is, with two settings XLA needs:
- it is made from the model while the model is still on the host, then moved: made from a model on
  the XLA device, its constructor fails (`torch.Generator(device=xla)`: "XLA device type not an
  accelerator"; timm 1.0.31), the generator being for bf16 stochastic rounding;
- `stochastic_rounding=False`, and a float32 EMA of a bf16 model (`--precision bf16`): that rounding
  would draw from a host generator on device tensors. In float32 the update needs no rounding.

The average is ours (ModelEma), timm's arithmetic, on one flat buffer per dtype:
- timm's `update(model)` walks `state_dict().values()` on every call, which torch.compile cannot
  guard ("'odict_values' object is not subscriptable"), so inside dynamo-full's captured update it
  fails;
- a lerp per weight tensor makes every weight tensor of the EMA one more output buffer of the step's
  graph. Per buffer the runtime's cost is fixed, so on a small model that cost, not the arithmetic,
  is the EMA's price: `vit-digits` (52 tensors, 0.47 M weights) ran 8-17% slower per step with a
  `_foreach_lerp_` per tensor, 2-3% with one lerp of the flat buffer against the weights
  concatenated in the graph (scripts/bench_recipe.py --parts device; docs/measurements.md).
The update is traced lazily into the step's graph or, under dynamo-full, captured as a small graph
of its own (torch.optim breaks the captured graph around `optimizer.step()`: one more launch per step);
the weight 1 - decay is the same value every step (data, never 0 or 1); no `.item()`, no Python
decision on a device value, no host round trip. timm's module keeps the averages only when asked
(`module()`, for an evaluation or a checkpoint): the flat buffer is read to the host and split into
its tensors, which keeps the evaluation on the raw model's graph (no graph of its own), at the cost
of a host round trip of the EMA's weights per evaluation. (timm's decay warm-up would give a new
value each step; it is not offered.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from neuron_train.training.config import RunConfig

if TYPE_CHECKING:  # timm itself is imported only with --model-ema
    from timm.utils import ModelEmaV3


def build_ema(cfg: RunConfig, host_model: torch.nn.Module) -> ModelEmaV3 | None:
    """ModelEmaV3 of `host_model` (still on the host), or None without --model-ema."""
    if not cfg.recipe.model_ema:
        return None
    from timm.utils import ModelEmaV3

    dtype = torch.float32 if cfg.train.precision == "bf16" else None
    return ModelEmaV3(host_model, decay=cfg.recipe.model_ema_decay, stochastic_rounding=False, dtype=dtype)


class ModelEma:
    """timm's ModelEmaV3 (`timm_ema`, its module on the device) averaging `model` (on the device, after
    any broadcast), its float weights in one flat buffer per dtype (this module's docstring)."""

    def __init__(self, timm_ema: ModelEmaV3, model: torch.nn.Module):
        self.timm = timm_ema
        pairs = list(zip(timm_ema.module.state_dict(keep_vars=True).values(),
                         model.state_dict(keep_vars=True).values(), strict=True))
        self.groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for e, m in pairs:
            if e.is_floating_point():
                ema_tensors, model_tensors = self.groups.setdefault(e.dtype, ([], []))
                ema_tensors.append(e)
                model_tensors.append(m)
        self.copies = [(e, m) for e, m in pairs if not e.is_floating_point()]
        self.weight = 1.0 - timm_ema.decay
        self.device = next(model.parameters()).device
        # the averages start as the model's weights (after the broadcast: every rank alike)
        self.flat = {dtype: self._gather(model_tensors, dtype) for dtype, (_, model_tensors) in self.groups.items()}

    def _gather(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        # host transfer at start-up and resume only: concatenated on the device instead, the cat would
        # fold into the first step's graph and make it differ from the second's (the step compiled twice)
        return torch.cat([t.detach().cpu().reshape(-1).to(dtype) for t in tensors]).to(self.device)

    @torch.no_grad()
    def update(self) -> None:
        """`average <- lerp(average, model, 1 - decay)` (ModelEmaV3.apply_update_'s arithmetic)."""
        for dtype, (_, model_tensors) in self.groups.items():
            weights = torch.cat([m.reshape(-1) for m in model_tensors]).to(dtype)  # float32 EMA of bf16: cast
            self.flat[dtype].lerp_(weights, self.weight)
        for e, m in self.copies:
            e.copy_(m)

    def module(self) -> torch.nn.Module:
        """timm's EMA module holding the current averages, for an evaluation or a checkpoint."""
        for dtype, (ema_tensors, _) in self.groups.items():
            # host transfer per evaluation/checkpoint (never per step): new device data of the same
            # shapes keeps the evaluation on the raw model's graph, where a device-side split would
            # compile a graph of its own
            host = self.flat[dtype].cpu()
            for e, chunk in zip(ema_tensors, host.split([e.numel() for e in ema_tensors]), strict=True):
                e.data = chunk.view(e.shape).to(self.device)
        return self.timm.module

    def reload(self) -> None:
        """Take the averages from timm's module again (after a resume loaded them into it)."""
        self.flat = {dtype: self._gather(ema_tensors, dtype) for dtype, (ema_tensors, _) in self.groups.items()}
