"""The task contract and the plain classification task.

A task is what a training step computes from a batch: `task(images, labels)` returns a dict of
scalar losses; 'loss' is back-propagated, every other entry is logged. `per_sample(...)` (a
`PerSampleTask`) gives the same losses one value per sample (sifting ranks them) and `info()` gives
figures merged into the run summary. Distillation and sifting are tasks built around another task,
by composition.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class Task(Protocol):
    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def info(self) -> dict: ...

    def state_tensors(self) -> list[torch.Tensor]:
        """Device state the task writes each step (outputs of the step's graph, beside the losses)."""
        ...


class PerSampleTask(Task, Protocol):
    """A task that also gives its losses per sample: what sifting wraps (classification, distillation)."""

    def per_sample(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]: ...


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

    def state_tensors(self) -> list[torch.Tensor]:
        return []
