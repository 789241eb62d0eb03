"""Tasks: what a training step computes from a batch. A task returns a dict of scalar losses.

'loss' is what is back-propagated; every other entry is logged. Other techniques (distillation,
sifting) are tasks built around this one, by composition: every task also exposes `per_sample`
(the same losses, one value per sample, which sifting ranks) and `info()` (figures merged into
the run summary).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from neuron_train.config import RunConfig


def batch_mean(per_sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A task's batch losses from its per-sample ones."""
    return {name: v.mean() for name, v in per_sample.items()}


class ClassificationTask:
    def __init__(self, model: torch.nn.Module):
        self.model = model

    def per_sample(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.model(images)
        return {"loss": F.cross_entropy(logits.float(), labels, reduction="none")}

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return batch_mean(self.per_sample(images, labels))

    def info(self) -> dict:
        return {}


def build_task(cfg: RunConfig, model: torch.nn.Module, device: torch.device, *,
               step: Callable[[], int], mark_phase: Callable[[str], None]):
    """Classification, wrapped in distillation (--teacher-model) and/or sifting (--sift).

    `step()` gives the optimizer step being trained (sifting uses it for --sift-delay);
    `mark_phase(name)` labels the graphs compiled from then on (GraphWatch.phase).
    """
    task = ClassificationTask(model)
    if cfg.distill.teacher_model:
        from neuron_train.distill import DistillationTask, load_teacher

        # The teacher must predict the student's classes at the student's input size.
        teacher = load_teacher(cfg.distill, num_classes=model.num_classes, img_size=cfg.model.img_size)
        task = DistillationTask(model, teacher.to(device), cfg.distill)
    if cfg.sift.sift != "off":
        from neuron_train.sift import SiftingTask

        task = SiftingTask(task, cfg.sift, cfg.train.batch_size, cfg.train.grad_accum, step,
                           mark_phase, device)
    return task
