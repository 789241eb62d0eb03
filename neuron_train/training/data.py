"""Datasets (digits, synthetic, image folder) and static-shape, per-rank loaders for XLA.

XLA compiles one graph per input shape, so every training batch has the same shape (drop_last) and
evaluation pads its last batch to full size with a validity mask instead of sending a short one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from neuron_train.common.errors import UsageError
from neuron_train.training.config import DataConfig

_DIGITS_VAL = 300          # fixed validation split of the 1797 digits, independent of --seed
_SYNTHETIC_POOL = 64       # distinct random images behind the synthetic dataset (loading stays cheap)
_MEAN, _STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class DigitsDataset(Dataset):
    """scikit-learn's 8x8 handwritten digits (ships with the package: real data, offline), upscaled."""

    def __init__(self, split: str, img_size: int):
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
        keep = order[:_DIGITS_VAL] if split == "val" else order[_DIGITS_VAL:]
        self.images, self.labels, self.img_size = images[keep], labels[keep], img_size
        self.num_classes = 10

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        img = F.interpolate(self.images[i][None, None], size=(self.img_size, self.img_size),
                            mode="bilinear", align_corners=False)[0]
        return (img.expand(3, -1, -1) - 0.5) / 0.5, self.labels[i]


class SyntheticDataset(Dataset):
    """Random images and labels, for throughput benchmarks (the numbers mean nothing to learn)."""

    def __init__(self, size: int, img_size: int, num_classes: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.pool = torch.randn(_SYNTHETIC_POOL, 3, img_size, img_size, generator=g)
        self.size, self.num_classes = size, num_classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        return self.pool[i % _SYNTHETIC_POOL], torch.tensor(i % self.num_classes)


def _folder(path: Path, img_size: int, train: bool) -> Dataset:
    from torchvision import datasets, transforms

    resize = [transforms.Resize(img_size), transforms.CenterCrop(img_size)]
    flip = [transforms.RandomHorizontalFlip()] if train else []
    tf = transforms.Compose(resize + flip + [transforms.ToTensor(), transforms.Normalize(_MEAN, _STD)])
    try:
        ds = datasets.ImageFolder(str(path), transform=tf)
    except (FileNotFoundError, RuntimeError) as exc:
        raise UsageError(f"--data-dir: {path}: {str(exc).splitlines()[0]}") from None
    ds.num_classes = len(ds.classes)
    return ds


@dataclass
class Datasets:
    train: Dataset
    val: Dataset | None
    num_classes: int


def build_datasets(cfg: DataConfig, img_size: int, num_classes: int, seed: int) -> Datasets:
    if cfg.dataset == "digits":
        train, val = DigitsDataset("train", img_size), DigitsDataset("val", img_size)
    elif cfg.dataset == "synthetic":
        classes = num_classes or 1000
        train = SyntheticDataset(cfg.synthetic_size, img_size, classes, seed)
        val = SyntheticDataset(max(256, cfg.synthetic_size // 8), img_size, classes, seed + 1)
    else:
        root = Path(cfg.data_dir)
        has_split = (root / "train").is_dir()
        train = _folder(root / "train" if has_split else root, img_size, train=True)
        val = _folder(root / "val", img_size, train=False) if (root / "val").is_dir() else None
    if num_classes and num_classes < train.num_classes:
        raise UsageError(f"--num-classes {num_classes} is smaller than the {train.num_classes} "
                         f"classes in the {cfg.dataset} dataset")
    return Datasets(train, val, num_classes or train.num_classes)


class ShardSampler(Sampler[int]):
    """This rank's share of one epoch, in DistributedSampler's order, resumable mid-epoch.

    The permutation depends only on (seed, epoch), so a run on N ranks sees the same samples per
    step as a run on one rank with an N-times larger batch. `start` skips samples already trained
    on before a checkpoint, without loading them.
    """

    def __init__(self, n: int, world: int, rank: int, *, shuffle: bool, seed: int, epoch: int,
                 batch_size: int, start: int = 0):
        self.n, self.world, self.rank = n, world, rank
        self.shuffle, self.seed, self.epoch, self.start = shuffle, seed, epoch, start
        self.per_rank = (n // world) // batch_size * batch_size   # drop_last: full batches only

    def _indices(self) -> list[int]:
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.n)
        return order[self.rank::self.world][:self.per_rank].tolist()

    def __iter__(self):
        return iter(self._indices()[self.start:])

    def __len__(self) -> int:
        return max(0, self.per_rank - self.start)


class PaddedEvalShard(Dataset):
    """This rank's evaluation samples, padded to whole batches; padding has valid=0."""

    def __init__(self, ds: Dataset, world: int, rank: int, batch_size: int):
        self.ds, self.indices = ds, list(range(rank, len(ds), world))
        self.padded = max(1, math.ceil(len(self.indices) / batch_size)) * batch_size

    def __len__(self) -> int:
        return self.padded

    def __getitem__(self, i: int):
        valid = i < len(self.indices)
        x, y = self.ds[self.indices[i] if valid else self.indices[0]]
        return x, torch.as_tensor(y), torch.tensor(1.0 if valid else 0.0)


def train_batches_per_epoch(n: int, world: int, batch_size: int) -> int:
    return (n // world) // batch_size


def _loader(ds: Dataset, batch_size: int, num_workers: int, sampler=None) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, sampler=sampler, drop_last=True,
                      num_workers=num_workers, persistent_workers=False,
                      pin_memory=False, prefetch_factor=4 if num_workers else None)


def train_loader(ds: Dataset, cfg: DataConfig, *, batch_size: int, accum: int, world: int, rank: int,
                 seed: int, epoch: int, start_batch: int = 0) -> DataLoader:
    """Full optimizer steps only (batch x accum); starts after `start_batch` batches (resume)."""
    sampler = ShardSampler(len(ds), world, rank, shuffle=True, seed=seed, epoch=epoch,
                           batch_size=batch_size * accum, start=start_batch * batch_size)
    return _loader(ds, batch_size, cfg.num_workers, sampler)


def eval_loader(ds: Dataset, cfg: DataConfig, *, batch_size: int, world: int, rank: int) -> DataLoader:
    return _loader(PaddedEvalShard(ds, world, rank, batch_size), batch_size, cfg.num_workers)


def to_device(loader: DataLoader, device: torch.device, batches_per_execution: int = 1):
    """Wrap a loader with MpDeviceLoader: background upload, and a graph boundary per batch."""
    import torch_xla.distributed.parallel_loader as pl

    return pl.MpDeviceLoader(loader, device, batches_per_execution=batches_per_execution)
