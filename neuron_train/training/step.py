"""How a training step becomes XLA graphs: the step compiler and the precision context.

- lazy: every op of forward, backward and update is traced in Python each step (torch_xla's own
  way, what Neuron's samples do); the host's tracing competes with execution on a small machine.
- dynamo: torch.compile with torch's openxla backend (compiling keeps the random seed, see
  _seed_keeping_compiler) captures forward and backward once; the update is
  still traced lazily each step.
- dynamo-full (the default): the update (gradient clipping + optimizer step) is captured as well,
  so a step costs the host a few guard checks and graph launches, not a trace (except with ZeRO-1
  and the legacy bf16 environment modes, where the update stays lazy: see StepPath). AdamW's update
  returns the new weights and state rather than writing its inputs (captured_update.py), traced once
  on the device without dynamo (cached_graph.py).

Whichever it is, the graphs stay the same from step 2 on (checked by GraphWatch/check-graphs)
and precompile's graph tour reaches them all (tests/precompile/test_precompile.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import torch
import torch_xla
import torch_xla._dynamo.dynamo_bridge as bridge
import torch_xla.core.xla_model as xm
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from neuron_train.training import zero1
from neuron_train.training.cached_graph import CachedGraph
from neuron_train.training.captured_update import CapturedAdamW
from neuron_train.training.config import LEGACY_BF16_PRECISIONS, RunConfig
from neuron_train.training.device import Backend
from neuron_train.training.flat_optim import FlatOptimizer
from neuron_train.training.optim import build_optimizer, clip_grad_norm, set_lr
from neuron_train.training.tasks import Task

if TYPE_CHECKING:
    from neuron_train.training.ema import ModelEma

P = ParamSpec("P")
R = TypeVar("R")


def autocast(precision: str) -> torch.autocast:
    """bf16-autocast: matmuls in bf16, weights and loss in f32. Other modes need no context."""
    if precision == "bf16-autocast":
        return torch.autocast("xla", dtype=torch.bfloat16)
    return torch.autocast("xla", enabled=False)


def _seed_keeping_compiler(gm: torch.fx.GraphModule, _fake_inputs: list[torch.Tensor]) -> Callable[..., Any]:
    """torch's openxla compiler (torch/_dynamo/backends/torchxla.py), except that compiling leaves the
    XLA random seed where it was. torch_xla's graph extraction calls torch_xla.sync() several times,
    and every sync advances the seed: the stream drop-path draws from would depend on when the graphs
    were compiled, so a run resumed from a checkpoint (which compiles after restoring the seed) would
    draw other masks than the uninterrupted run (which compiled at step 0). Executions still advance
    the seed once each (torch_xla's dynamo_bridge), as in the uninterrupted run."""
    compiled = None

    def run(*args: torch.Tensor) -> Any:
        nonlocal compiled
        if compiled is None:
            seed = xm.get_rng_state()
            compiled = _extract_compiled_graph(gm, args)
            xm.set_rng_state(seed)
        return compiled(*args)

    return make_boxed_func(run)


def _extract_compiled_graph(gm: torch.fx.GraphModule, args: Sequence[Any]) -> Callable[..., Any]:
    """torch_xla's `extract_compiled_graph`, partitioning the graph for CPU fallback only when a node
    does fall back. torch_xla partitions every graph: it runs it once to find the nodes without an XLA
    lowering, then, found or not, fuses the rest into submodules (torch.fx's fuser, slow on a graph
    with many inputs) and runs the graph again to collect their inputs. When every node lowers, the
    one partition is the whole graph, which torch_xla compiles directly for graphs with symbolic
    inputs (`extract_internal`). ViT-Tiny's captured AdamW update: 11.7 -> 5.9 s of the first step."""
    partition = bridge.partition_fx_graph_for_cpu_fallback
    bridge.partition_fx_graph_for_cpu_fallback = functools.partial(_partition_if_falling_back, partition)
    try:
        return bridge.extract_compiled_graph(gm, args)
    finally:
        bridge.partition_fx_graph_for_cpu_fallback = partition


def _partition_if_falling_back(partition: Callable[..., Any], gm: torch.fx.GraphModule, args: Sequence[Any],
                               all_args: list[Any], tensor_args: list[torch.Tensor]) -> Any:
    """torch_xla's first pass (find the nodes that fall back to the CPU, then undo what running the graph
    did to its inputs and drop the IR it traced); with none found, the whole graph compiled as one."""
    cloned = [torch.clone(a) if isinstance(a, torch.Tensor) else a for a in all_args]
    collector = bridge.UnsupportedNodesCollector(gm)
    collector.run(*args)
    bridge._clear_pending_irs_on_args(tensor_args, cloned)
    torch_xla._XLAC._clear_pending_irs(str(torch_xla.device()))
    if collector.get_unsupported_nodes():
        return partition(gm, args, all_args, tensor_args)  # torch_xla's own path, first pass again
    setattr(gm, "xla_args", args)  # noqa: B010 - what extract_internal reads (torch_xla's symbolic-input path)
    return bridge.extract_internal(gm)


# The min-cut partition (torch.compile's inductor default) saves fewer activations for the backward
# graph and recomputes cheap pointwise ops there instead; never random ops (dropout, drop-path's
# bernoulli) nor matmuls, so a step computes the same (to float rounding). aot_autograd's default
# partition saves every tensor the backward reads: on ViT-Tiny/16 64 px batch 32 (CPU device) min-cut
# took the step from 360 to 326 ms (docs/measurements.md, issue 45).
_OPENXLA_SEED_KEEPING = aot_autograd(fw_compiler=_seed_keeping_compiler,
                                     partition_fn=min_cut_rematerialization_partition)


def _captured(fn: Callable[P, R]) -> Callable[P, R]:
    # Replays the captured graphs without re-tracing Python each step; one graph per input shape.
    return torch.compile(fn, backend=_OPENXLA_SEED_KEEPING, dynamic=False)


class StepPath:
    """One optimizer step of the loop (`step`): `forward(images, labels)` -> losses per micro-batch,
    then `update()` -> gradient norm (clip + optimizer step, and the EMA). The loop runs it; `plan`
    traces the same step lazily (`capture=False`: the captured graphs' ops, read before they run)."""

    def __init__(self, cfg: RunConfig, task: Task, model: torch.nn.Module, backend: Backend, *,
                 ema: ModelEma | None = None, capture: bool = True) -> None:
        compiler, optim = cfg.train.step_compiler, cfg.optim
        # ZeRO-1 updates its own way. The legacy XLA_USE_BF16 / XLA_DOWNCAST_BF16 modes make every f32
        # tensor bf16 on the device, where a captured AdamW's bias correction 1 - 0.999**t rounds to 0
        # (NaN weights): there the update is traced lazily, its corrections computed on the host.
        # The flat update keeps its step counter on the host (as torch's lazy AdamW does): a captured
        # graph would guard on it, so it is traced lazily too.
        # Traced for plan (capture=False), the update is the lazy one: a capturable AdamW refuses to run
        # outside a graph on XLA, and its device-side bias correction is a few scalar ops.
        captured_update = (capture and compiler == "dynamo-full" and not optim.zero1
                           and optim.optimizer_impl != "flat" and cfg.train.precision not in LEGACY_BF16_PRECISIONS)
        self.model, self.clip, self.task = model, optim.grad_clip, task
        self.ema, self.backend, self.zero1 = ema, backend, optim.zero1
        self.accum, self.precision = cfg.train.grad_accum, cfg.train.precision
        self.input_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
        self.foreach = optim.optimizer_impl == "foreach"
        self.optimizer = build_optimizer(model, optim, backend, captured=captured_update)
        dynamo = capture and compiler in ("dynamo", "dynamo-full")
        self.forward = _captured(task) if dynamo else task
        # Captured, AdamW's update is one graph that returns the new weights and state instead of changing
        # them in place (captured_update.py: no copy-back per tensor), traced once without dynamo
        # (cached_graph.py). SGD runs torch.optim's step with
        # its graph breaks (`_use_grad`: clipping, SGD, the EMA in three graphs): captured without them,
        # its momentum buffers, made at the first step, broke aot_autograd's copy-back of changed inputs
        # ("output with shape [32] doesn't match the broadcast shape [32, 32]", tests/training/test_options.py).
        self.update: Callable[[], torch.Tensor] = self._update
        if captured_update and isinstance(self.optimizer, torch.optim.AdamW):
            self.update = CapturedAdamW(self.optimizer, self.clip, ema, CachedGraph)
        elif captured_update:
            self.update = _captured(self._update)
        # A captured backward's incoming gradient must be device data: the autograd-made one (ones, / accum)
        # is pending IR, and torch_xla's dynamo bridge syncs it and waits for the device (the forward)
        # before launching the backward, every step. Made once, uploaded (no graph), in the loss's dtype.
        self._seed: torch.Tensor | None = None
        self._seed_needed = dynamo

    def step(self, next_batch: Callable[[], Sequence[torch.Tensor]], lr: float,
             mark: Callable[[str], None]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """`accum` micro-batches (each from `next_batch()`) forward and backward, then the update at
        `lr`; `mark(phase)` after each phase (the profiler's). Returns the last losses and the norm."""
        for _ in range(self.accum):
            images, labels = next_batch()  # the loop's: a graph boundary, the previous step starts executing
            images = images.to(self.input_dtype)
            with autocast(self.precision):
                losses = self.forward(images, labels)
            mark("forward")
            self._backward(losses["loss"])
            mark("backward")
        set_lr(self.optimizer, lr)
        if self.zero1:  # reduce-scatter, global-norm clip, shard update, all-gather
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update()  # traced into this step's graph: no sync, no read
            grad_norm = zero1.grad_norm(self.optimizer)
            mark("grad_sync")
        else:
            self.backend.reduce_gradients(self.optimizer)  # xm.optimizer_step, split to clip in between
            mark("grad_sync")
            with torch.no_grad():  # as torch.optim's step runs: captured, one inference graph
                grad_norm = self.update()  # clip + optimizer.step(), captured or traced
        self.optimizer.zero_grad(set_to_none=True)
        return losses, grad_norm

    def _backward(self, loss: torch.Tensor) -> None:
        """`(loss / accum).backward()`; captured, with the gradient 1 / accum handed in as device data."""
        if not self._seed_needed:
            (loss / self.accum).backward()
            return
        if self._seed is None or self._seed.dtype != loss.dtype:
            self._seed = torch.tensor(1.0 / self.accum, dtype=loss.dtype).to(loss.device)
        loss.backward(self._seed)

    def _update(self) -> torch.Tensor:
        if isinstance(self.optimizer, FlatOptimizer):  # clipping is part of the flat update
            grad_norm = self.optimizer.clip_and_step(self.clip)
        else:
            params: list[torch.Tensor] = list(self.model.parameters())
            if self.clip:
                grad_norm = clip_grad_norm(params, self.clip, foreach=self.foreach)
            else:
                grad_norm = torch.zeros((), device=params[0].device)
            self.optimizer.step()
        if self.ema is not None:  # --model-ema: one lerp of the flat average, no host read (ema.py)
            self.ema.update()
        return grad_norm

    def state(self) -> list[torch.Tensor]:
        """The device tensors a step writes, besides its losses and norm: weights and buffers, the
        optimizer's state (and a ZeRO-1 shard's weights, a captured LR), the EMA's, the task's."""
        opt = self.optimizer
        inner: torch.optim.Optimizer = getattr(opt, "base_optimizer", opt)  # ZeRO-1: the shard's optimizer
        state = opt.state_tensors() if isinstance(opt, FlatOptimizer) else [
            t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
        groups = [t for g in inner.param_groups for v in g.values()
                  for t in (v if isinstance(v, list) else [v]) if torch.is_tensor(t)]
        ema = self.ema.state_tensors() if self.ema is not None else []
        found = [*self.model.state_dict(keep_vars=True).values(), *state, *groups, *ema, *self.task.state_tensors()]
        unique = {id(t): t for t in found if t.device.type == "xla"}
        return list(unique.values())
