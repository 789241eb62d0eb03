"""Tasks: what a training step computes from a batch. A task returns a dict of scalar losses.

'loss' is what is back-propagated; every other entry is logged. Other techniques (distillation,
sifting) are tasks built around this one, by composition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ClassificationTask:
    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.model(images)
        return {"loss": F.cross_entropy(logits.float(), labels)}
