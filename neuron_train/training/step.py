"""How a training step becomes XLA graphs: the step compiler and the precision context.

- lazy: every op of forward, backward and update is traced in Python each step (torch_xla's own
  way, what Neuron's samples do); the host's tracing competes with execution on a small machine.
- dynamo: torch.compile with torch's openxla backend (compiling keeps the random seed, see
  _seed_keeping_compiler) captures forward and backward once; the update is
  still traced lazily each step.
- dynamo-full (the default): the update (gradient clipping + optimizer step) is captured as well,
  so a step costs the host a few guard checks and graph launches, not a trace (except with ZeRO-1
  and the legacy bf16 environment modes, where the update stays lazy: see StepPath).

Whichever it is, the graphs stay the same from step 2 on (checked by GraphWatch/check-graphs)
and precompile's graph tour reaches them all (tests/precompile/test_precompile.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import torch
import torch_xla.core.dynamo_bridge as dynamo_bridge
import torch_xla.core.xla_model as xm
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from neuron_train.training.config import LEGACY_BF16_PRECISIONS, RunConfig
from neuron_train.training.device import Backend
from neuron_train.training.flat_optim import FlatOptimizer
from neuron_train.training.optim import build_optimizer, clip_grad_norm
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
            compiled = dynamo_bridge.extract_compiled_graph(gm, args)
            xm.set_rng_state(seed)
        return compiled(*args)

    return make_boxed_func(run)


_OPENXLA_SEED_KEEPING = aot_autograd(fw_compiler=_seed_keeping_compiler)


def _captured(fn: Callable[P, R]) -> Callable[P, R]:
    # Replays the captured graphs without re-tracing Python each step; one graph per input shape.
    return torch.compile(fn, backend=_OPENXLA_SEED_KEEPING, dynamic=False)


class StepPath:
    """`forward(images, labels)` -> losses, and `update()` -> gradient norm (clip + optimizer step)."""

    def __init__(self, cfg: RunConfig, task: Task, model: torch.nn.Module, backend: Backend, *,
                 ema: ModelEma | None = None) -> None:
        compiler, optim = cfg.train.step_compiler, cfg.optim
        # ZeRO-1 updates its own way. The legacy XLA_USE_BF16 / XLA_DOWNCAST_BF16 modes make every f32
        # tensor bf16 on the device, where a captured AdamW's bias correction 1 - 0.999**t rounds to 0
        # (NaN weights): there the update is traced lazily, its corrections computed on the host.
        # The flat update keeps its step counter on the host (as torch's lazy AdamW does): a captured
        # graph would guard on it, so it is traced lazily too.
        captured_update = (compiler == "dynamo-full" and not optim.zero1 and optim.optimizer_impl != "flat"
                           and cfg.train.precision not in LEGACY_BF16_PRECISIONS)
        self.model, self.clip = model, optim.grad_clip
        self.ema = ema
        self.foreach = optim.optimizer_impl == "foreach"
        self.optimizer = build_optimizer(model, optim, backend, captured=captured_update)
        self.forward = _captured(task) if compiler in ("dynamo", "dynamo-full") else task
        self.update = _captured(self._update) if captured_update else self._update

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
