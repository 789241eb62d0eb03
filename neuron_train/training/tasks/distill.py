"""Knowledge distillation: a frozen teacher's softened logits teach a smaller trainable student.

loss = alpha * T^2 * KL(softmax(teacher/T) || softmax(student/T)) + (1 - alpha) * CE(student, labels)

This is Hinton et al.'s soft-target loss, as timm's distillation task computes it (`kl_div` of the
student's log-probabilities against the teacher's, batch mean): the KL term compares the student's
tempered distribution with the teacher's, and T^2 keeps its gradients on the scale of the CE term
when T changes.

The teacher lives only inside the task: it is not a submodule of the student, so it is not in the
optimizer, not reduced across ranks, not in the student's checkpoints. It runs in eval mode under
no_grad with requires_grad off, in the same XLA graph as the student's step.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from neuron_train.common.errors import UsageError
from neuron_train.training.config import DistillConfig
from neuron_train.training.models import count_parameters, create_model, read_state_dict
from neuron_train.training.tasks.base import batch_mean


def distillation_losses(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                        labels: torch.Tensor, alpha: float, temperature: float) -> dict[str, torch.Tensor]:
    """Per-sample losses {'loss', 'ce_loss', 'kd_loss'}, each of shape [B]; their means are the
    batch losses (the KL term's batch mean is kl_div's 'batchmean')."""
    t = temperature
    log_p_student = F.log_softmax(student_logits.float() / t, dim=-1)
    log_p_teacher = F.log_softmax(teacher_logits.float() / t, dim=-1)
    kd = F.kl_div(log_p_student, log_p_teacher, reduction="none", log_target=True).sum(-1) * (t * t)
    ce = F.cross_entropy(student_logits.float(), labels, reduction="none")
    return {"loss": alpha * kd + (1.0 - alpha) * ce, "ce_loss": ce, "kd_loss": kd}


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _shape_mismatches(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    extra = [k for k in state if k not in own]
    wrong = [f"{k} {list(state[k].shape)} in the file, {list(own[k].shape)} in the model"
             for k in own if k in state and state[k].shape != own[k].shape]
    return wrong + [f"{k} missing from the file" for k in missing] + [f"{k} not in the model" for k in extra]


def load_teacher(cfg: DistillConfig, *, num_classes: int, img_size: int) -> torch.nn.Module:
    """Build the teacher and load every one of its weights from the checkpoint, or refuse."""
    # cast: build_task calls this only with --teacher-model set, and DistillConfig.validate has
    # refused --teacher-model without --teacher-checkpoint before start-up
    teacher = create_model(cast(str, cfg.teacher_model), num_classes=num_classes, img_size=img_size)
    state = read_state_dict(cast(str, cfg.teacher_checkpoint))
    problems = _shape_mismatches(teacher, state)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise UsageError(f"--teacher-checkpoint {cfg.teacher_checkpoint} does not fit --teacher-model "
                         f"{cfg.teacher_model} at --img-size {img_size} with {num_classes} classes: "
                         + "; ".join(problems[:3]) + more)
    teacher.load_state_dict(state)
    return freeze(teacher)


class DistillationTask:
    """Student trained on the teacher's soft targets and the labels; returns timm-style losses."""

    def __init__(self, student: torch.nn.Module, teacher: torch.nn.Module, cfg: DistillConfig):
        self.student, self.cfg = student, cfg
        self.teacher_params = count_parameters(teacher)
        self.teacher = teacher.to(torch.bfloat16) if cfg.teacher_bf16 else teacher
        self.teacher_dtype = next(self.teacher.parameters()).dtype

    def teacher_logits(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.teacher(images.to(self.teacher_dtype)).float()

    def per_sample(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return distillation_losses(self.student(images), self.teacher_logits(images), labels,
                                   self.cfg.distill_alpha, self.cfg.distill_temperature)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return batch_mean(self.per_sample(images, labels))

    def info(self) -> dict:
        return {"teacher_model": self.cfg.teacher_model, "teacher_params": self.teacher_params,
                "student_params": count_parameters(self.student),
                "teacher_bf16": self.cfg.teacher_bf16}

    def state_tensors(self) -> list[torch.Tensor]:
        return []  # the teacher is frozen: read, never written
