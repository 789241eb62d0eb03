"""Device and process-group setup: Neuron (XLA collectives) or the CPU XLA device (gloo bridge).

Environment variables that torch_xla reads at start-up (PJRT_DEVICE, XLA_USE_BF16, ...) must be set
before the first `import torch_xla`, so `resolve_precision` (every command that runs our loop calls
it, once) runs before anything imports it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.neuron_env import default_pjrt_device, extracting_graphs, neuron_device_present
from neuron_train.common.values import shown
from neuron_train.training.config import RunConfig

T = TypeVar("T")

_LEGACY_BF16_ENV = {"xla-use-bf16": "XLA_USE_BF16", "xla-downcast-bf16": "XLA_DOWNCAST_BF16"}


def resolve_precision(cfg: RunConfig) -> RunConfig:
    """The run's configuration with its precision resolved, the XLA environment set for it: what a
    command runs, saves and reports. Call before anything imports torch_xla (prepare_environment)."""
    # validated again: a precision from XLA_USE_BF16 in the environment meets the same refusals as the flag
    return replace(cfg, train=replace(cfg.train, precision=prepare_environment(cfg.train.precision))).validate()


def prepare_environment(precision: str) -> str:
    """Set the XLA environment for `precision` before torch_xla starts; return the precision used.

    The legacy XLA_USE_BF16 / XLA_DOWNCAST_BF16 variables may also come from the user's shell
    (as in the original scripts): then they decide the precision, and a conflicting flag is an error.
    """
    os.environ["PJRT_DEVICE"] = default_pjrt_device()
    from_env = [mode for mode, var in _LEGACY_BF16_ENV.items() if os.environ.get(var) == "1"]
    if len(from_env) > 1:
        raise UsageError("set only one of XLA_USE_BF16=1 and XLA_DOWNCAST_BF16=1")
    if from_env:
        if precision not in ("fp32", from_env[0]):
            raise UsageError(f"{_LEGACY_BF16_ENV[from_env[0]]}=1 is set in the environment, which "
                             f"conflicts with --precision {precision}; unset it or drop the flag")
        precision = from_env[0]
    if precision in _LEGACY_BF16_ENV:
        os.environ[_LEGACY_BF16_ENV[precision]] = "1"
    for name, value in neuron_precision_env(precision, os.environ["PJRT_DEVICE"]).items():
        os.environ.setdefault(name, value)  # a value the user set wins
    return precision


def check_launch() -> None:
    """Before torch_xla starts: PJRT_DEVICE must name a device this machine has, and WORLD_SIZE > 1
    needs a launcher (torch_xla or torch.distributed would otherwise abort with a traceback)."""
    value = os.environ.get("PJRT_DEVICE")
    kind = (value or "CPU").upper()
    devices = {"GPU": "nvidia[0-9]*", "CUDA": "nvidia[0-9]*", "TPU": "accel[0-9]*"}
    if kind not in ("CPU", "NEURON", *devices):
        raise UsageError(f"PJRT_DEVICE={value} is not a device torch_xla knows (CPU, NEURON, CUDA, TPU): "
                         "unset PJRT_DEVICE")
    here = "NEURON" if neuron_device_present() else "CPU"
    if value is not None and value != kind:  # our check read it in any case; torch_xla does not
        raise UsageError(f"PJRT_DEVICE={value}: torch_xla reads device names in capitals: set PJRT_DEVICE={kind}, "
                         f"or unset PJRT_DEVICE (neuron-train then uses {here})")
    if kind in devices and not any(Path("/dev").glob(devices[kind])):
        raise UsageError(f"PJRT_DEVICE={value}, but this machine has no {kind} device: unset PJRT_DEVICE "
                         f"(neuron-train then uses {here}) or run where that device is")
    if kind == "NEURON":
        _check_neuron()
    for name in _LEGACY_BF16_ENV.values():  # torch_xla reads anything else as off, silently: fp32
        if os.environ.get(name, "0") not in ("0", "1"):
            raise UsageError(f"{name}={shown(os.environ[name])} is neither 1 nor 0 (torch_xla would read it as 0 "
                             f"and train in fp32): set {name}=1, or unset it and use --precision")
    world = env_int("WORLD_SIZE", 1)
    if world > 1 and not os.environ.get("MASTER_ADDR"):
        raise UsageError(f"WORLD_SIZE={world} is set, but no launcher started this process (no MASTER_ADDR): "
                         f"launch with torchrun --standalone --nproc_per_node={world}, or unset WORLD_SIZE")


def _check_neuron() -> None:
    """PJRT_DEVICE=NEURON needs the Neuron PJRT plugin, and a Neuron device unless this is
    neuron_parallel_compile's graph extraction (which compiles on the host)."""
    if importlib.util.find_spec("libneuronxla") is None:
        raise UsageError("PJRT_DEVICE=NEURON, but the Neuron PJRT plugin (libneuronxla, from torch-neuronx) is "
                         "not installed: unset PJRT_DEVICE (neuron-train then uses CPU) or install the Neuron SDK")
    if not neuron_device_present() and not extracting_graphs():
        raise UsageError("PJRT_DEVICE=NEURON, but this machine has no Neuron device (/dev/neuron*): unset "
                         "PJRT_DEVICE (neuron-train then uses CPU) or run on a trn1/inf2 instance")


def neuron_precision_env(precision: str, pjrt_device: str) -> dict[str, str]:
    """The Neuron runtime variables `precision` needs on `pjrt_device` (none off Neuron).

    bf16 weights without stochastic rounding lose small updates (Neuron's documented fix)."""
    if precision != "fp32" and pjrt_device == "NEURON":
        return {"NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"}
    return {}


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"environment variable {name}={value!r} is not an integer") from None


@dataclass
class Backend:
    """Where this process trains and how it talks to the other data-parallel ranks."""

    kind: str                 # PJRT device type: 'NEURON', 'CPU', 'TPU', 'CUDA'
    device: torch.device
    world_size: int           # data-parallel ranks (torchrun's WORLD_SIZE)
    rank: int
    local_rank: int
    gloo_bridge: bool         # CPU multi-process: gradients all-reduced through gloo on the host
    host_group: dist.ProcessGroup | None  # gloo group for host-side objects (run dir, eval totals)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Average gradients over ranks (the first half of `xm.optimizer_step`)."""
        if self.world_size == 1:
            return
        if self.gloo_bridge:
            _gloo_average(optimizer, self.world_size, self.device)
        else:
            import torch_xla.core.xla_model as xm

            xm.reduce_gradients(optimizer)

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        """Make every rank start from rank 0's weights (same seed should already agree; make sure)."""
        if self.world_size == 1:
            return
        if self.gloo_bridge:
            with torch.no_grad():
                for p in model.parameters():
                    host = p.detach().cpu()  # host transfer, once at start-up
                    dist.broadcast(host, src=0, group=self.host_group)
                    p.copy_(host.to(self.device))
        else:
            import torch_xla.core.xla_model as xm

            xm.broadcast_master_param(model)

    def all_sum(self, values: list[float]) -> list[float]:
        """Sum host numbers over ranks (eval totals, stop flags): off the hot loop."""
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.host_group)
        return t.tolist()

    def all_gather_object(self, obj: object) -> list:
        if self.world_size == 1:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.host_group)
        return out

    def broadcast_object(self, obj: T) -> T:
        """Rank 0's `obj` on every rank (each rank passes one of the same type)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.host_group)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _gloo_average(optimizer: torch.optim.Optimizer, world_size: int, device: torch.device) -> None:
    """All-reduce gradients through gloo: XLA collectives do not run on the CPU XLA device.

    All gradients travel as one flat f32 buffer: one device->host transfer (a host sync: it runs
    the forward/backward graph) and one upload, instead of hundreds of small ones.
    """
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.detach().reshape(-1).float() for g in grads]).cpu()
    dist.all_reduce(flat)
    flat /= world_size
    flat_dev = flat.to(device)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat_dev[offset:offset + n].view_as(g).to(g.dtype))
        offset += n


def check_world(world: int, joined: int, xla_world: int, gloo_bridge: bool) -> None:
    """torchrun's WORLD_SIZE must be the world we really train in, or ranks train alone.

    On CPU each process owns one XLA device (XLA world 1) and gloo joins them; elsewhere the XLA
    world itself must span all ranks.
    """
    if joined != world or xla_world != (1 if gloo_bridge else world):
        raise RunError(f"torchrun started WORLD_SIZE={world} processes but the process group has "
                       f"{joined} and the XLA world {xla_world}: refusing to train {world} "
                       "independent replicas")


def local_backend() -> Backend:
    """This process alone on its XLA device (world size 1): what `plan` traces a step on."""
    import torch_xla
    import torch_xla.runtime as xr

    return Backend(kind=str(xr.device_type()), device=torch_xla.device(), world_size=1, rank=0, local_rank=0,
                   gloo_bridge=False, host_group=None)


def init_backend() -> Backend:
    """Join the torchrun world (if any) and pick the XLA device. Call after prepare_environment."""
    import torch_xla
    import torch_xla.runtime as xr

    world = env_int("WORLD_SIZE", 1)
    rank = env_int("RANK", 0)
    local_rank = env_int("LOCAL_RANK", 0)
    kind = xr.device_type()
    if kind is None:  # prepare_environment sets PJRT_DEVICE
        raise RuntimeError("PJRT_DEVICE is not set: call prepare_environment() before init_backend()")
    gloo_bridge = False
    host_group: dist.ProcessGroup | None = None
    if world > 1:
        if kind == "CPU":
            # torchrun + init_process_group('xla') on CPU silently gives each process world size 1:
            # bridge through gloo instead, and check that the ranks really joined.
            dist.init_process_group("gloo")
            gloo_bridge = True
            host_group = dist.group.WORLD
        else:
            import torch_xla.distributed.xla_backend  # noqa: F401  registers the 'xla' backend

            dist.init_process_group("xla", init_method="xla://")
            host_group = dist.new_group(backend="gloo")
        check_world(world, dist.get_world_size(), xr.world_size(), gloo_bridge)
    elif kind != "CPU" and xr.world_size() != 1:
        raise RunError(f"one process but the XLA world has {xr.world_size()} ranks: launch with "
                       f"torchrun --standalone --nproc_per_node={xr.world_size()}")
    return Backend(kind=kind, device=torch_xla.device(), world_size=world, rank=rank,
                   local_rank=local_rank, gloo_bridge=gloo_bridge, host_group=host_group)
