"""How a training step is turned into XLA graphs: precision context and step compiler."""

from __future__ import annotations

import torch


def autocast(precision: str):
    """bf16-autocast: matmuls in bf16, weights and loss in f32. Other modes need no context."""
    if precision == "bf16-autocast":
        return torch.autocast("xla", dtype=torch.bfloat16)
    return torch.autocast("xla", enabled=False)


def compile_forward(task, step_compiler: str):
    """The task as the step calls it: traced lazily every step, or captured once by dynamo."""
    if step_compiler == "dynamo":
        # Dynamo replays the captured forward/backward graphs without re-tracing Python each step.
        return torch.compile(task, backend="openxla", dynamic=False)
    return task
