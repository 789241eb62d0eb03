"""From a RunConfig to what a training run is made of, in one place: the data, the model, the task and
the step. The loop (loop.py) trains with them, the run folder (rundir.py) counts the run's steps with
them, `plan` (cost/plan/measure.py) traces their step, `bench` (cost/bench/measure.py, cost/bench/result.py)
builds its model and reads its facts from them. A step feature added here (or in the step, the task,
the optimizer) is what every one of them sees: none keeps a copy of its own.

Light at import (rundir checks a run before torch_xla starts): the step's modules are imported by
`build_run` only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from neuron_train.common.errors import UsageError
from neuron_train.training.config import RunConfig
from neuron_train.training.data import (
    ClassDataset,
    Datasets,
    build_datasets,
    train_batches_per_epoch,
    train_loader,
)
from neuron_train.training.models import build_model, count_parameters

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from neuron_train.training.augment import SoftTargetCollate
    from neuron_train.training.device import Backend
    from neuron_train.training.ema import ModelEma
    from neuron_train.training.step import StepPath
    from neuron_train.training.tasks import Task


def build_data(cfg: RunConfig) -> Datasets:
    """The run's datasets (--num-classes 0: the dataset's classes)."""
    return build_datasets(cfg.data, cfg.model.img_size, cfg.model.num_classes, cfg.train.seed)


def steps_per_epoch(cfg: RunConfig, train_samples: int, world: int) -> int:
    """Optimizer steps in one epoch of `train_samples` over `world` ranks; a usage error (with the
    batch size that fits) when not even one step fits."""
    t = cfg.train
    per_epoch = train_batches_per_epoch(train_samples, world, t.batch_size) // t.grad_accum
    if per_epoch == 0:
        most = train_samples // (world * t.grad_accum)
        fix = f"use --batch-size {most} or less" if most else "use fewer ranks or a larger dataset"
        raise UsageError(f"the {cfg.data.dataset} training set ({train_samples} samples) has less than one "
                         f"step of {t.batch_size} x {t.grad_accum} x {world} ranks: {fix}")
    return per_epoch


def total_steps(cfg: RunConfig, per_epoch: int) -> int:
    """The run's optimizer steps: --max-steps, else --epochs epochs of `per_epoch` (`steps_per_epoch`)."""
    return cfg.train.max_steps or cfg.train.epochs * per_epoch


def host_model(cfg: RunConfig, num_classes: int, *, weights: bool = True) -> torch.nn.Module:
    """The configured model on the host (or on the device in force, e.g. meta), with its stochastic
    depth, and its --pretrained weights unless `weights` is False (counting shapes only)."""
    return build_model(cfg.model.name, num_classes=num_classes, img_size=cfg.model.img_size,
                       drop_path=cfg.model.drop_path, pretrained=cfg.model.pretrained if weights else None)


@dataclass
class Run:
    """What a run trains: its data, the model on the device (and its EMA), the task and the step."""

    cfg: RunConfig
    data: Datasets
    train_set: ClassDataset                 # through --aa / --reprob (augment.py)
    collate: SoftTargetCollate | None       # --mixup / --cutmix / --smoothing: soft targets
    model: torch.nn.Module
    params: int
    ema: ModelEma | None
    task: Task
    path: StepPath

    def epoch_loader(self, *, world: int, rank: int, epoch: int, start_batch: int = 0) -> DataLoader:
        """This rank's host batches of `epoch` from `start_batch` on, as the loop trains on them."""
        from neuron_train.training.augment import AugmentedTensors

        t, train_set = self.cfg.train, self.train_set
        if isinstance(train_set, AugmentedTensors):  # this epoch's, its samples' draws seeded
            train_set = train_set.at(epoch)
        collate = self.collate and self.collate.at(rank=rank, epoch=epoch, first_batch=start_batch)
        return train_loader(train_set, self.cfg.data, batch_size=t.batch_size, accum=t.grad_accum, world=world,
                            rank=rank, seed=t.seed, epoch=epoch, start_batch=start_batch, collate=collate)


def device_model(cfg: RunConfig, num_classes: int, backend: Backend) -> tuple[torch.nn.Module, int, ModelEma | None]:
    """The model on the backend's device (every rank from rank 0's weights), its parameter count and
    its EMA (--model-ema)."""
    from neuron_train.training.ema import ModelEma, build_ema

    model = host_model(cfg, num_classes)
    params = count_parameters(model)
    if cfg.train.precision == "bf16":
        model = model.to(torch.bfloat16)  # pure bf16 weights; Neuron rounds stochastically
    timm_ema = build_ema(cfg, model)  # before the move: timm's EMA cannot be made on XLA (ema.py)
    model = model.to(backend.device)
    backend.broadcast_parameters(model)
    ema = None
    if timm_ema is not None:
        timm_ema.module.to(backend.device)
        ema = ModelEma(timm_ema, model)  # from the broadcast weights: every rank's EMA starts the same
    return model, params, ema


def build_run(cfg: RunConfig, backend: Backend, data: Datasets, *, step: Callable[[], int],
              mark_phase: Callable[[str], None], capture: bool = True) -> Run:
    """The run's components from its configuration. `step()`: the optimizer step being trained
    (sifting's delay); `mark_phase(name)`: labels the graphs compiled from then on; `capture=False`:
    the step traced lazily whatever --step-compiler says (plan reads its ops before they run)."""
    from neuron_train.training.augment import recipe_training_set
    from neuron_train.training.step import StepPath
    from neuron_train.training.tasks import build_task

    train_set, collate = recipe_training_set(cfg, data)
    model, params, ema = device_model(cfg, data.num_classes, backend)
    task = build_task(cfg, model, backend.device, step=step, mark_phase=mark_phase)
    path = StepPath(cfg, task, model, backend, ema=ema, capture=capture)
    return Run(cfg, data, train_set, collate, model, params, ema, task, path)


def inference_model(cfg: RunConfig, num_classes: int) -> tuple[torch.nn.Module, torch.dtype]:
    """The model as inference runs it (bench's compiled forward, plan's inference): evaluation mode,
    its weights in the dtype its inputs take (bf16 for --precision bf16, else float32)."""
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    return host_model(cfg, num_classes).eval().to(dtype), dtype


def inference_forward(model: torch.nn.Module, images: torch.Tensor, precision: str) -> torch.Tensor:
    """One inference forward: no gradients, under the precision's autocast."""
    from neuron_train.training.step import autocast

    with torch.no_grad(), autocast(precision):
        return model(images)
