"""The model EMA (--model-ema): timm's ModelEmaV3, made on the host and updated in the step's graph.

timm's ModelEmaV3 is used as it is, with two settings XLA needs:
- it is made from the model while the model is still on the host, then moved: made from a model on
  the XLA device, its constructor fails (`torch.Generator(device=xla)`: "XLA device type not an
  accelerator"; timm 1.0.31), the generator being for bf16 stochastic rounding;
- `stochastic_rounding=False`, and a float32 EMA of a bf16 model (`--precision bf16`): that rounding
  would draw from a host generator on device tensors. In float32 the update needs no rounding.
  Under `--precision xla-downcast-bf16` (XLA_DOWNCAST_BF16) a float32 tensor is bf16 on the device,
  where the update (1 - decay = 2e-4 of the difference) is below half a bf16 ulp: round to nearest
  leaves the average where it started (tests/training/test_recipe.py, CPU). There the EMA is float64, which
  that mode keeps as float32 on the device. Under xla-use-bf16 every float is bf16 on the device:
  config.py refuses --model-ema with it.

The average is ours (ModelEma), timm's arithmetic, on one flat buffer per dtype:
- timm's `update(model)` walks `state_dict().values()` on every call, which torch.compile cannot
  guard ("'odict_values' object is not subscriptable"), so inside dynamo-full's captured update it
  fails;
- a lerp per weight tensor makes every weight tensor of the EMA one more output buffer of the step's
  graph. Per buffer the runtime's cost is fixed, so on a small model that cost, not the arithmetic,
  is the EMA's price: `vit-digits` (52 tensors, 0.47 M weights) ran 8-17% slower per step with a
  `_foreach_lerp_` per tensor, 2-3% with one lerp of the flat buffer against the weights
  concatenated in the graph (scripts/bench_recipe.py --parts device; docs/measurements.md).
The update is traced lazily into the step's graph or, under dynamo-full, captured into the update's
graph with clipping and AdamW (captured_update.py: no launch of its own, and the average follows the
weights that graph computes);
the weight 1 - decay is the same value every step (data, never 0 or 1); no `.item()`, no Python
decision on a device value, no host round trip. timm's module gets the averages only when asked
(`module()`, for an evaluation, in the model's dtypes; `state_dict()`, for a checkpoint, at the
EMA's own precision): the flat buffer is read to the host and split into its tensors, which keeps
the evaluation on the raw model's graph (no graph of its own), at the cost of a host round trip of
the EMA's weights per evaluation. (timm's decay warm-up would give a new
value each step; it is not offered.)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
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

    dtype = {"bf16": torch.float32, "xla-downcast-bf16": torch.float64}.get(cfg.train.precision)
    return ModelEmaV3(host_model, decay=cfg.recipe.model_ema_decay, stochastic_rounding=False, dtype=dtype)


@dataclass
class _Group:
    """The weights of one EMA dtype: their names, the EMA module's tensors and the model's."""

    names: list[str] = field(default_factory=list)
    ema: list[torch.Tensor] = field(default_factory=list)
    model: list[torch.Tensor] = field(default_factory=list)


class ModelEma:
    """timm's ModelEmaV3 (`timm_ema`, its module on the device) averaging `model` (on the device, after
    any broadcast), its float weights in one flat buffer per dtype (this module's docstring)."""

    def __init__(self, timm_ema: ModelEmaV3, model: torch.nn.Module):
        self.timm = timm_ema
        entries = list(zip(timm_ema.module.state_dict(keep_vars=True).items(),
                           model.state_dict(keep_vars=True).values(), strict=True))
        self.groups: dict[torch.dtype, _Group] = {}
        for (name, e), m in entries:
            if e.is_floating_point():
                group = self.groups.setdefault(e.dtype, _Group())
                group.names.append(name)
                group.ema.append(e)
                group.model.append(m)
        self.copies = {name: (e, m) for (name, e), m in entries if not e.is_floating_point()}
        self.weight = 1.0 - timm_ema.decay
        self.device = next(model.parameters()).device
        # the averages start as the model's weights (after the broadcast: every rank alike)
        self.flat = {dtype: self._upload(g.model, dtype) for dtype, g in self.groups.items()}

    def _upload(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        # host transfer at start-up and resume only: concatenated on the device instead, the cat would
        # fold into the first step's graph and make it differ from the second's (the step compiled twice)
        return torch.cat([t.detach().cpu().reshape(-1).to(dtype) for t in tensors]).to(self.device)

    def model_tensors(self) -> list[torch.Tensor]:
        """The model's float tensors the averages follow, in the order `averaged(new=...)` takes them."""
        return [m for group in self.groups.values() for m in group.model]

    @torch.no_grad()
    def update(self) -> None:
        """`average <- lerp(average, model, 1 - decay)` (ModelEmaV3.apply_update_'s arithmetic), traced
        into the step's graph (a captured AdamW's graph uses `averaged` instead)."""
        for average, weights in zip(self.flat.values(), self._concatenated(self.model_tensors()), strict=True):
            average.lerp_(weights, self.weight)
        self.copy_buffers()

    def copy_buffers(self) -> None:
        """The non-float buffers the EMA copies from the model (BatchNorm's counts), in place: traced."""
        for e, m in self.copies.values():
            e.copy_(m)

    def step_inputs(self, updated: Sequence[bool]) -> list[torch.Tensor]:
        """What `averaged` reads besides the new weights: the averages, then the model tensors the update
        does not write (`updated[k]` False for the k-th of `model_tensors()`: buffers)."""
        return [*self.flat.values(), *(m for m, u in zip(self.model_tensors(), updated, strict=True) if not u)]

    def averaged(self, inputs: Sequence[torch.Tensor], new: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """`update()`'s arithmetic into new tensors, for a graph that changes none of its inputs
        (captured_update.py): `inputs` as `step_inputs()` gave them, `new[k]` the k-th model tensor as
        the update leaves it (None where it does not write it). Returns the new averages, for `assign`
        (the buffers it copies: `copy_buffers`)."""
        rest = iter(inputs[len(self.flat):])
        now = [m if m is not None else next(rest) for m in new]
        return [average.lerp(weights, self.weight)
                for average, weights in zip(inputs[:len(self.flat)], self._concatenated(now), strict=True)]

    def assign(self, averages: Sequence[torch.Tensor]) -> None:
        """The averages `averaged()` computed, now the EMA's (device data: no copy, no pending IR)."""
        self.flat = dict(zip(self.flat, averages, strict=True))

    def _concatenated(self, now: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Per dtype, `now` (in `model_tensors()`'s order) as one flat tensor in the EMA's dtype."""
        start = 0
        for dtype, group in self.groups.items():
            part = now[start:start + len(group.model)]
            start += len(group.model)
            yield torch.cat([m.reshape(-1) for m in part]).to(dtype)  # float32 EMA of bf16: cast

    def state_tensors(self) -> list[torch.Tensor]:
        """The averages and copied buffers a step writes (outputs of its graph)."""
        return [*self.flat.values(), *(e for e, _ in self.copies.values())]

    def _averages(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(name, EMA module tensor, model tensor, current average on the host) for every float weight."""
        for dtype, group in self.groups.items():
            host = self.flat[dtype].cpu()  # host transfer per evaluation/checkpoint, never per step
            chunks = host.split([e.numel() for e in group.ema])
            yield from ((n, e, m, c.view(e.shape)) for n, e, m, c in zip(group.names, group.ema, group.model, chunks,
                                                                         strict=True))

    def module(self) -> torch.nn.Module:
        """timm's EMA module holding the current averages in the model's dtypes, for an evaluation: new
        device data of the raw model's shapes and dtypes keeps it on the raw model's eval graph (a
        device-side split would compile a graph of its own; a float32 EMA of a bf16 model would take
        bf16 inputs into float32 layers)."""
        for _, e, m, average in self._averages():
            e.data = average.to(self.device, dtype=m.dtype)
        return self.timm.module

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages at their own precision, on the host, by timm's module's names (a checkpoint's)."""
        state = {name: e.detach().cpu() for name, (e, _) in self.copies.items()}
        state.update((name, average.clone()) for name, _, _, average in self._averages())
        return {name: state[name] for name in self.timm.module.state_dict()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """The averages of a checkpoint's `state_dict()` (a resume; names and shapes checked before)."""
        for dtype, group in self.groups.items():
            self.flat[dtype] = self._upload([state[name] for name in group.names], dtype)
