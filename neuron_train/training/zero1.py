"""ZeRO-1 (`--zero1`): each data-parallel rank keeps the optimizer state of only 1/N of the weights.

Both implementations are torch optimizers whose `step()` does the whole data-parallel update:
average the gradients (reduce-scatter: each rank receives the mean gradient of its shard only),
clip them to the *global* norm (summed over the shards of all ranks), update the rank's shard
(fp32 master weights and optimizer moments live only there), all-gather the updated shards into the
full weights. The training loop therefore skips its own gradient all-reduce and clipping.

- XLA collectives (Neuron, and the CPU device at world size 1): torch_xla's
  ZeroRedundancyOptimizer, as the Neuron samples use it (`pin_layout=False`), saving the master
  weights so a bf16 run resumes exactly.
- CPU with several processes: XLA collectives do not run on the CPU device (they hang), and
  torch_xla's class would see a world of 1 there and train N unsynchronised replicas. GlooZero1 does
  the same algorithm with the collectives on the host through gloo (one flat reduce-scatter, one
  flat all-gather per step) and the shard update on the XLA device.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from neuron_train.common.errors import UsageError
from neuron_train.training.flat_optim import FlatOptimizer

if TYPE_CHECKING:
    from neuron_train.training.device import Backend


def build_zero1(param_groups: list[dict], optimizer_class: type[torch.optim.Optimizer],
                defaults: dict, *, max_norm: float, backend: Backend) -> torch.optim.Optimizer:
    """The ZeRO-1 optimizer for this backend; `max_norm` 0 disables clipping."""
    if backend.gloo_bridge:
        return GlooZero1(param_groups, optimizer_class, world_size=backend.world_size, rank=backend.rank,
                         device=backend.device, max_norm=max_norm, group=backend.host_group, **defaults)
    from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

    # torch_xla annotates `params` as Iterator[Tensor], but hands them to torch.optim.Optimizer, which
    # takes param groups (as the Neuron samples pass them): the annotation is narrower than the code.
    params = cast("Iterator[torch.Tensor]", param_groups)
    return ZeroRedundancyOptimizer(params, optimizer_class, optimizer_dtype=torch.float32,
                                   grad_clipping=max_norm > 0, max_norm=max_norm or None,
                                   pin_layout=False, save_master_weights=True, **defaults)


def grad_norm(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The global gradient norm of the last step (before clipping); zeros when clipping is off."""
    from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

    if not isinstance(optimizer, (GlooZero1, ZeroRedundancyOptimizer)):
        raise TypeError(f"not a ZeRO-1 optimizer: {type(optimizer).__name__}")
    norm = optimizer.grad_norm
    return torch.zeros(()) if norm is None else norm


def state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for the optimizer: its moments/step counts, and ZeRO's master shards.

    Reads shapes and dtypes only: no device transfer.
    """
    base = getattr(optimizer, "base_optimizer", optimizer)
    if isinstance(base, FlatOptimizer):  # --optimizer-impl flat: its state is flat buckets
        return {"optimizer_state_bytes": sum(_nbytes(t) for t in base.state_tensors()), "master_weight_bytes": 0}
    moments = sum(_nbytes(t) for s in base.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    master = 0
    if base is not optimizer:  # ZeRO-1: the shards the base optimizer updates are fp32 copies
        master = sum(_nbytes(p) for g in base.param_groups for p in g["params"])
    return {"optimizer_state_bytes": moments, "master_weight_bytes": master}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class FlatLayout:
    """One parameter group flattened and zero-padded to a multiple of the world size.

    Rank r owns elements [r * shard, (r + 1) * shard) of the padded buffer.
    """

    numels: tuple[int, ...]
    world_size: int

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def shard(self) -> int:
        return -(-self.total // self.world_size)

    @property
    def padded(self) -> int:
        return self.shard * self.world_size


def rank_major(tensors_per_group: list[list[torch.Tensor]], layouts: list[FlatLayout]) -> torch.Tensor:
    """Flatten the groups into one (world, sum of shard sizes) f32 buffer: row r is what rank r owns.

    Its flat view is what a single reduce-scatter splits into one contiguous block per rank.
    """
    columns = []
    for tensors, layout in zip(tensors_per_group, layouts, strict=True):
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        flat = F.pad(flat, (0, layout.padded - layout.total))
        columns.append(flat.view(layout.world_size, layout.shard))
    return torch.cat(columns, dim=1)


def unflatten(rows: torch.Tensor, layouts: list[FlatLayout]) -> torch.Tensor:
    """Inverse of `rank_major` for the gathered (world, sum of shard sizes) buffer: the unpadded
    parameters of every group, concatenated in parameter order."""
    parts = rows.split([layout.shard for layout in layouts], dim=1)
    return torch.cat([part.reshape(-1)[:layout.total]
                      for part, layout in zip(parts, layouts, strict=True)])


class GlooZero1(torch.optim.Optimizer):
    """ZeRO-1 for the CPU gloo bridge: collectives on the host, shard updates on the XLA device.

    Per step: one device->host transfer of the gradients (a host sync that runs the forward and
    backward), one gloo reduce-scatter, one upload of this rank's gradient shard, the optimizer on
    the shard, one device->host transfer of the updated shard (a second host sync), one gloo
    all-gather and one upload of the full weights. More host round trips than plain data
    parallelism on the bridge: ZeRO-1 saves memory, not time.
    """

    def __init__(self, param_groups: list[dict], optimizer_class: type[torch.optim.Optimizer], *,
                 world_size: int, rank: int, device: torch.device, max_norm: float,
                 group: dist.ProcessGroup | None = None, **defaults: Any):
        super().__init__(param_groups, defaults)
        self.world_size, self.rank, self.device = world_size, rank, device
        self.max_norm, self.group = max_norm, group
        self.layouts = [FlatLayout(tuple(p.numel() for p in g["params"]), world_size)
                        for g in self.param_groups]
        with torch.no_grad():
            rows = rank_major([g["params"] for g in self.param_groups], self.layouts).cpu()  # once
        mine = rows[rank].split([layout.shard for layout in self.layouts])
        shard_groups = [{**_hyper(g), "params": [torch.nn.Parameter(s.clone().to(device))]}
                        for g, s in zip(self.param_groups, mine, strict=True)]
        self.base_optimizer = optimizer_class(shard_groups, **defaults)
        self.grad_norm = torch.zeros(())

    def _shards(self) -> list[torch.nn.Parameter]:
        return [g["params"][0] for g in self.base_optimizer.param_groups]

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]  # refuses a closure, unlike torch's
        if closure is not None:
            raise ValueError("GlooZero1.step takes no closure")
        for group, shard_group in zip(self.param_groups, self.base_optimizer.param_groups, strict=True):
            shard_group.update(_hyper(group))  # the loop sets the LR on our param_groups
        grad_shard = self._reduce_scatter_gradients()
        norm = self._global_norm(grad_shard)
        self.grad_norm = torch.tensor(norm, dtype=torch.float32)
        if self.max_norm > 0:
            coef = self.max_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s formula
            if coef < 1.0:
                grad_shard.mul_(coef)
        on_device = grad_shard.to(self.device).split([layout.shard for layout in self.layouts])
        for shard, grad in zip(self._shards(), on_device, strict=True):
            shard.grad = grad
        self.base_optimizer.step()
        self.base_optimizer.zero_grad(set_to_none=True)
        self._all_gather_parameters()

    def _reduce_scatter_gradients(self) -> torch.Tensor:
        grads = [[p.grad if p.grad is not None else torch.zeros_like(p) for p in g["params"]]
                 for g in self.param_groups]
        rows = rank_major(grads, self.layouts).cpu()  # host sync: runs the forward/backward graph
        mine = torch.empty(rows.shape[1])
        dist.reduce_scatter_tensor(mine, rows.reshape(-1), group=self.group)
        return mine.div_(self.world_size)

    def _global_norm(self, grad_shard: torch.Tensor) -> float:
        """The L2 norm over all shards of all ranks: this shard's sum of squares, summed over ranks."""
        sq = grad_shard.double().pow(2).sum().reshape(1)
        dist.all_reduce(sq, group=self.group)
        return float(sq.sqrt())

    def _all_gather_parameters(self) -> None:
        mine = torch.cat([s.detach() for s in self._shards()]).cpu()  # host sync: runs the update
        rows = torch.empty(self.world_size * mine.numel())
        dist.all_gather_into_tensor(rows, mine, group=self.group)
        flat = unflatten(rows.view(self.world_size, -1), self.layouts).to(self.device)
        offset = 0
        for group in self.param_groups:
            for p in group["params"]:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p).to(p.dtype))
                offset += n

    def state_dict(self) -> dict:
        return {"kind": "gloo-zero1", "world_size": self.world_size, "rank": self.rank,
                "numels": [list(layout.numels) for layout in self.layouts],
                "param_groups": [_hyper(g) for g in self.param_groups],
                "base": self.base_optimizer.state_dict(),
                "master": [s.detach() for s in self._shards()]}

    def load_state_dict(self, state: dict) -> None:
        where = (state.get("kind"), state.get("world_size"), state.get("rank"), state.get("numels"))
        mine = ("gloo-zero1", self.world_size, self.rank, [list(lay.numels) for lay in self.layouts])
        if where != mine:
            raise UsageError(f"the ZeRO-1 optimizer shard was saved by rank {where[2]} of {where[1]} "
                             f"({where[0]}) for other parameters; this is rank {self.rank} of "
                             f"{self.world_size}: resume with the same model and number of ranks")
        for group, saved in zip(self.param_groups, state["param_groups"], strict=True):
            group.update(saved)
        self.base_optimizer.load_state_dict(state["base"])
        with torch.no_grad():
            for shard, master in zip(self._shards(), state["master"], strict=True):
                shard.copy_(master.to(self.device))


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}
