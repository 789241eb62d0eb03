"""The model EMA (--model-ema): timm's ModelEmaV3, made on the host and updated in the step's graph.

timm's ModelEmaV3 is used as it is, with two settings XLA needs:
- it is made from the model while the model is still on the host, then moved: made from a model on
  the XLA device, its constructor fails (`torch.Generator(device=xla)`: "XLA device type not an
  accelerator"; timm 1.0.31), the generator being for bf16 stochastic rounding;
- `stochastic_rounding=False`, and a float32 EMA of a bf16 model (`--precision bf16`): that rounding
  would draw from a host generator on device tensors. In float32 the update needs no rounding.

The update is ours (EmaUpdate), timm's arithmetic: timm's `update(model)` walks
`state_dict().values()` on every call, which torch.compile cannot guard ("'odict_values' object is
not subscriptable"), so inside dynamo-full's captured update it fails. EmaUpdate makes the lists of
tensor pairs once and runs the same `torch._foreach_lerp_` with the weight 1 - decay (the same value
every step) and the same copies of integer buffers, called from the step's update: traced lazily into
the step's graph, or, under dynamo-full, one small graph of its own launched right after the captured
update (measured: one graph more than without --model-ema, compiled at step 0, none later); no
`.item()`, no Python decision on a device value, no host round trip. (timm's decay warm-up would give a new value each step; it is not offered.)
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


class EmaUpdate:
    """`ema.module <- lerp(ema.module, model, 1 - decay)` (ModelEmaV3.apply_update_'s arithmetic) over
    tensor lists made once, after both models are on the device (a resume's load_state_dict copies
    into these same tensors)."""

    def __init__(self, ema: ModelEmaV3, model: torch.nn.Module):
        pairs = list(zip(ema.module.state_dict(keep_vars=True).values(),
                         model.state_dict(keep_vars=True).values(), strict=True))
        self.ema_floats = [e for e, _ in pairs if e.is_floating_point()]
        self.model_floats = [m for e, m in pairs if e.is_floating_point()]
        self.copies = [(e, m) for e, m in pairs if not e.is_floating_point()]
        self.weight = 1.0 - ema.decay
        self.same_dtype = all(e.dtype == m.dtype for e, m in pairs if e.is_floating_point())

    @torch.no_grad()
    def __call__(self) -> None:
        if self.same_dtype:
            torch._foreach_lerp_(self.ema_floats, self.model_floats, weight=self.weight)
        else:  # a float32 EMA of bf16 weights: add_ promotes in the kernel (timm's own fallback)
            torch._foreach_mul_(self.ema_floats, 1.0 - self.weight)
            torch._foreach_add_(self.ema_floats, self.model_floats, alpha=self.weight)
        for e, m in self.copies:
            e.copy_(m)
