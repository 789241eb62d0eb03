"""Tasks: what a training step computes from a batch (the contract is `base.Task`).

`build_task` composes them: classification, wrapped in distillation and/or sifting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from neuron_train.training.config import RunConfig
from neuron_train.training.tasks.base import ClassificationTask, PerSampleTask, Task, batch_mean

__all__ = ["ClassificationTask", "PerSampleTask", "Task", "batch_mean", "build_task"]


def build_task(cfg: RunConfig, model: torch.nn.Module, device: torch.device, *,
               step: Callable[[], int], mark_phase: Callable[[str], None]) -> Task:
    """Classification, wrapped in distillation (--teacher-model) and/or sifting (--sift).

    `step()` gives the optimizer step being trained (sifting uses it for --sift-delay);
    `mark_phase(name)` labels the graphs compiled from then on (GraphWatch.phase).
    """
    task: PerSampleTask = ClassificationTask(model)
    if cfg.distill.teacher_model:
        from neuron_train.training.tasks.distill import DistillationTask, load_teacher

        # The teacher must predict the student's classes at the student's input size.
        # cast: create_model builds every model with timm, whose models keep num_classes as an int
        # (nn.Module's attribute lookup is typed Tensor | Module)
        teacher = load_teacher(cfg.distill, num_classes=cast(int, model.num_classes),
                               img_size=cfg.model.img_size)
        task = DistillationTask(model, teacher.to(device), cfg.distill)
    if cfg.sift.sift != "off":
        from neuron_train.training.tasks.sift import SiftingTask

        return SiftingTask(task, cfg.sift, cfg.train.batch_size, cfg.train.grad_accum, step,
                           mark_phase, device)
    return task
