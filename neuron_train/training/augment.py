"""timm's training recipe on the host: AutoAugment/RandAugment, random erasing, Mixup/CutMix and label
smoothing, all applied in the data loader (its worker processes, or the main process with
--num-workers 0), never on the XLA device.

Why on the host: the device then sees the same program every step. Mixup's weight and CutMix's box
are drawn anew for every batch; applied on the device, the weight would reach the graph as a Python
scalar (the values 0 and 1 become graph constants: another graph) and timm's CutMix slice
`x[:, :, yl:yh, xl:xh]` has a new shape almost every batch: a new graph almost every step. Mixed
on the host, the device receives a batch of fixed shape and soft targets of fixed shape, (batch,
classes) float32, whatever the draw (tests/training/test_recipe.py counts the compiled graphs both ways).

What is timm's and what is ours:
- the image policies and random erasing are timm's `create_transform(..., separate=True)` stages
  (its augmentation and its final tensor stage), used as they are;
- Mixup/CutMix is timm's `Mixup`, applied to each collated batch (host tensors);
- label smoothing without mixing is timm's `mixup_target` (a smoothed one-hot), so every recipe
  gives the step the same kind of target, and the loss stays torch's `F.cross_entropy`, which takes
  soft targets: per sample it equals timm's SoftTargetCrossEntropy / LabelSmoothingCrossEntropy
  (tested), which give only batch means (sifting ranks samples by their own losses, distillation
  adds a per-sample KL term).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from neuron_train.training.config import RecipeConfig, RunConfig
from neuron_train.training.data import NORMALISATION, ClassDataset, Datasets


@dataclass(frozen=True)
class ImageAugment:
    """timm's augmentation stage (a PIL transform, or None) and final stage (to tensor, normalise,
    random erasing) for images normalised with `mean` and `std`."""
    policy: Callable | None
    final: Callable


def image_augment(cfg: RecipeConfig, img_size: int, mean: tuple, std: tuple) -> ImageAugment | None:
    """timm's own stages for --aa / --reprob (None when neither is set).

    create_transform's first stage (random-resized crop, flip) is left out: each dataset keeps its
    own geometry (a flipped digit is another digit). The second stage is used only with --aa, where
    timm leaves colour jitter out (except for its '3a' policy); this recipe has no jitter flag.
    """
    if not cfg.aa and cfg.reprob == 0:
        return None
    from timm.data import create_transform

    _, secondary, final = create_transform(
        img_size, is_training=True, auto_augment=cfg.aa or None, hflip=0.0,
        re_prob=cfg.reprob, re_mode="pixel", re_count=1, mean=mean, std=std, separate=True)
    if cfg.aa:
        _posterize_zero_bits_as_black(secondary)
    return ImageAugment(secondary if cfg.aa else None, final)


def _posterize_zero_bits_as_black(policy: Callable) -> None:
    """timm's RandAugment posterizes to 4 - int(level * 0.4) bits: 0 bits at magnitude 10, which
    rand-m9-mstd0.5 reaches. Pillow 13 refuses 0 bits ("bits must be between or equal to 1 and 8",
    the loader dies); older Pillow made the image black, which is what the policy means. Swaps that
    op's function on this policy's own ops (timm's module is left alone)."""
    from PIL import Image
    from timm.data import auto_augment

    def posterize(img: Image.Image, bits_to_keep: int, **kwargs: Any) -> Image.Image:
        if bits_to_keep <= 0:
            return Image.new(img.mode, img.size)
        return auto_augment.posterize(img, bits_to_keep, **kwargs)

    for stage in getattr(policy, "transforms", [policy]):
        nested = getattr(stage, "policy", None) or [getattr(stage, "ops", [])]  # AutoAugment: sub-policies
        for op in (op for ops in nested for op in ops):
            if op.aug_fn is auto_augment.posterize:
                op.aug_fn = posterize


class AugmentedTensors(ClassDataset):
    """An in-memory dataset (samples are normalised tensors) through timm's image stages: the
    tensor becomes an 8-bit RGB image, as a decoded file would be, for the policy's PIL ops.

    Each sample's draws come from generators seeded by (run seed, epoch, sample index): timm draws
    them from Python's, numpy's and torch's global generators, which the step's thread moves too (the
    loader thread runs beside it, and torch.compile puts Python's and torch's states back after each
    compile: torch/_dynamo/convert_frame.py, preserve_global_state). Measured before: two runs with
    one seed and --aa parted at step 11, another pair at step 33.
    Seeded per sample, a run repeats itself and a resumed run augments its samples as the
    uninterrupted run did. `at(epoch)` gives the dataset of one epoch's loader."""

    def __init__(self, ds: ClassDataset, aug: ImageAugment, mean: tuple, std: tuple, seed: int = 0):
        self.ds, self.aug, self.seed, self.epoch = ds, aug, seed, 0
        self.num_classes = ds.num_classes
        self.mean, self.std = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]

    def at(self, epoch: int) -> AugmentedTensors:
        other = copy.copy(self)
        other.epoch = epoch
        return other

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from torchvision.transforms.functional import to_pil_image

        x, y = self.ds[i]
        pixels = (x * self.std + self.mean).clamp(0, 1)
        image = to_pil_image((pixels * 255).round().to(torch.uint8))
        with _seeded([self.seed, self.epoch, i]):
            if self.aug.policy is not None:
                image = self.aug.policy(image)
            return self.aug.final(image), y


@contextlib.contextmanager
def _seeded(key: list[int]) -> Iterator[None]:
    """Python's, numpy's and torch's (CPU) global generators seeded by `key`, their states put back
    after: what this sample draws depends on `key` alone, and other users of the generators see
    the states they left."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    number = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")
    random.seed(number)
    np.random.seed(key)
    torch.random.default_generator.manual_seed(number >> 1)  # < 2**63
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


class SoftTargetCollate:
    """Collates a batch, then mixes it with timm's Mixup/CutMix or smooths its labels (host tensors).

    A picklable object, not a closure: DataLoader workers receive it. Each batch's mixing is drawn
    from a generator seeded by (run seed, rank, epoch, batch index): the same batch gets the same
    draw whichever process or thread collates it, and a resumed run mixes its batches as the
    uninterrupted run did. numpy's global state saved in a checkpoint could not give that: the
    loader thread (MpDeviceLoader) and the workers collate batches ahead of the step, so at a
    checkpoint the state has already moved past batches the step never saw.
    `at(...)` gives the collate of one epoch's loader; batch k of that loader is the k-th call in
    the main process, or the (k // workers)-th call of worker k % workers (a DataLoader hands its
    batches to its workers in turn).
    """

    def __init__(self, cfg: RecipeConfig, num_classes: int, seed: int = 0):
        from timm.data import Mixup

        self.num_classes, self.smoothing, self.seed = num_classes, cfg.smoothing, seed
        self.rank, self.epoch, self.first_batch, self.calls = 0, 0, 0, 0
        self.mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, prob=cfg.mixup_prob,
                           switch_prob=cfg.mixup_switch_prob, mode="batch", label_smoothing=cfg.smoothing,
                           num_classes=num_classes) if mixing(cfg) else None

    def at(self, *, rank: int, epoch: int, first_batch: int) -> SoftTargetCollate:
        """This collate for the loader of `epoch` on `rank` whose first batch is `first_batch`."""
        other = copy.copy(self)
        other.rank, other.epoch, other.first_batch, other.calls = rank, epoch, first_batch, 0
        return other

    def batch_index(self) -> int:
        """The index in its epoch of the batch this call collates (counts the call)."""
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        index = self.first_batch + worker + self.calls * workers
        self.calls += 1
        return index

    def __call__(self, samples: list) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = default_collate(samples)
        if self.mixup is not None:
            # timm's Mixup draws from numpy's global generator: this batch's own seed, the state put back
            with _seeded([self.seed, self.rank, self.epoch, self.batch_index()]):
                return self.mixup(images, labels)  # mixes `images` in place, returns soft targets
        from timm.data.mixup import mixup_target

        return images, mixup_target(labels, self.num_classes, smoothing=self.smoothing)


def mixing(cfg: RecipeConfig) -> bool:
    """Is Mixup or CutMix on (timm train.py's `mixup_active`)?"""
    return cfg.mixup > 0 or cfg.cutmix > 0


def soft_targets(cfg: RecipeConfig) -> bool:
    """Does the step train on soft targets, (batch, classes) float32, instead of class indices?"""
    return mixing(cfg) or cfg.smoothing > 0


def recipe_training_set(cfg: RunConfig, data: Datasets) -> tuple[ClassDataset, SoftTargetCollate | None]:
    """The training set through --aa / --reprob, and the collate making soft targets (None: the
    DataLoader's own, class indices). A folder's images pass through 8-bit RGB again after their
    resize and crop, as timm's policies take PIL images: the augmented image is what a file of that
    size would decode to."""
    recipe, train = cfg.recipe, data.train
    mean, std = NORMALISATION[cfg.data.dataset]
    aug = image_augment(recipe, cfg.model.img_size, mean, std)
    if aug is not None:
        train = AugmentedTensors(train, aug, mean, std, cfg.train.seed)
    collate = SoftTargetCollate(recipe, data.num_classes, cfg.train.seed) if soft_targets(recipe) else None
    return train, collate
