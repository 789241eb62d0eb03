"""Datasets (digits, synthetic, image folder) and static-shape, per-rank loaders for XLA.

XLA compiles one graph per input shape, so every training batch has the same shape (drop_last) and
evaluation pads its last batch to full size with a validity mask instead of sending a short one.

An image folder is checked before training starts (training/rundir.py): `val/` classes are matched
to `train/` classes by name (a class only `val/` has is refused), and every image file is checked
cheaply (`image_problems`: not empty, a readable header, JPEG/PNG end marker present; a file
failing the end-marker test is decoded in full to confirm). A damaged file is refused in one line
naming it, before any run directory exists.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from neuron_train.common.errors import RunError, UsageError
from neuron_train.training.config import DataConfig

if TYPE_CHECKING:
    from torchvision.datasets import ImageFolder

_DIGITS_VAL = 300          # fixed validation split of the 1797 digits, independent of --seed
_SYNTHETIC_POOL = 64       # distinct random images behind the synthetic dataset (loading stays cheap)
_MEAN, _STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# The mean and std each dataset's samples are normalised with (digits: (x - 0.5) / 0.5; synthetic
# images are drawn from N(0, 1) and read the same way), for augmentations that undo it.
# A batch as the loaders make it: (images, labels), (images, soft targets) or, for evaluation,
# (images, labels, valid); torch's default collate makes it a list, SoftTargetCollate a tuple.
Batch = Sequence[torch.Tensor]
Collate = Callable[[list], Batch]  # how samples become a batch (DataLoader's collate_fn)
NORMALISATION = {"digits": ((0.5,) * 3, (0.5,) * 3), "synthetic": ((0.5,) * 3, (0.5,) * 3),
                 "folder": (_MEAN, _STD)}


class ClassDataset(Dataset):
    """(image, label) samples that know their count and their number of classes (torch's Dataset
    declares neither): what `build_datasets` makes. An image folder is torchvision's ImageFolder
    (typed Any: torchvision ships no type information), which has both once `_folder` sets
    num_classes."""

    num_classes: int

    def __len__(self) -> int:
        raise NotImplementedError


class DigitsDataset(ClassDataset):
    """scikit-learn's 8x8 handwritten digits (ships with the package: real data, offline), upscaled."""

    def __init__(self, split: str, img_size: int):
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
        keep = order[:_DIGITS_VAL] if split == "val" else order[_DIGITS_VAL:]
        # Upscaled and normalised once (18 MB at 32 px): a sample is then a slice, not a resize.
        up = F.interpolate(images[keep][:, None], size=(img_size, img_size), mode="bilinear",
                           align_corners=False)
        self.images, self.labels = (up - 0.5) / 0.5, labels[keep]
        self.num_classes = 10

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i].expand(3, -1, -1), self.labels[i]


class SyntheticDataset(ClassDataset):
    """Random images and labels, for throughput benchmarks (the numbers mean nothing to learn)."""

    def __init__(self, size: int, img_size: int, num_classes: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.pool = torch.randn(_SYNTHETIC_POOL, 3, img_size, img_size, generator=g)
        self.size, self.num_classes = size, num_classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool[i % _SYNTHETIC_POOL], torch.tensor(i % self.num_classes)


def _folder(path: Path, img_size: int, train: bool) -> ImageFolder:
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


@functools.lru_cache(maxsize=2)  # scanned once per process: checked before start-up, used after
def _folders(root: Path, img_size: int) -> tuple[ImageFolder, ImageFolder | None]:
    """train/ and val/ (or the root itself as train), val's labels matched to train's by name."""
    has_split = (root / "train").is_dir()
    train = _folder(root / "train" if has_split else root, img_size, train=True)
    if not (root / "val").is_dir():
        return train, None
    val = _folder(root / "val", img_size, train=False)
    extra = [c for c in val.classes if c not in train.class_to_idx]
    if extra:
        raise UsageError(f"--data-dir: {root / 'val'} has {len(extra)} class(es) that "
                         f"{root / 'train'} lacks ({', '.join(extra[:5])}): no model can learn "
                         "them; remove them from val/ or add training images")
    # ImageFolder numbers the classes of each folder on its own: a val/ missing one of train's
    # classes would shift every later label. Use train's numbering.
    val.samples = [(p, train.class_to_idx[val.classes[y]]) for p, y in val.samples]
    val.imgs, val.targets = val.samples, [y for _, y in val.samples]
    val.classes, val.class_to_idx, val.num_classes = train.classes, train.class_to_idx, train.num_classes
    return train, val


_END_MARKERS = {"JPEG": b"\xff\xd9", "PNG": b"IEND"}


def image_problem(path: str) -> str | None:
    """Why an image file cannot be trained on, or None. Reads the header and the last bytes only;
    a file without its format's end marker is decoded in full to confirm it is damaged."""
    from PIL import Image

    try:
        size = os.path.getsize(path)
        if size == 0:
            return "empty file (0 bytes)"
        with Image.open(path) as img:  # parses the header only
            marker = _END_MARKERS.get(img.format)
            if marker:
                with open(path, "rb") as fh:
                    fh.seek(max(0, size - 1024))
                    if marker not in fh.read():
                        img.load()  # the whole image: raises when the data really is cut short
    except Image.UnidentifiedImageError:
        return "not an image format PIL can read"
    except Exception as exc:  # PIL raises many types; any of them means the file cannot be used
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return None


def check_images(data: Datasets, root: Path) -> None:
    """Refuse a folder dataset holding an unreadable image, naming the first few (one line)."""
    from torchvision.datasets import ImageFolder

    # a folder dataset's train and val are ImageFolders (val may be absent)
    paths = [p for ds in (data.train, data.val) if isinstance(ds, ImageFolder) for p, _ in ds.samples]
    with ThreadPoolExecutor(max_workers=min(32, 4 * (os.cpu_count() or 1))) as pool:
        problems = [(p, why) for p, why in zip(paths, pool.map(image_problem, paths), strict=True) if why]
    if problems:
        shown = "; ".join(f"{os.path.relpath(p, root)}: {why}" for p, why in problems[:3])
        raise UsageError(f"--data-dir: {len(problems)} of {len(paths)} images in {root} cannot be read "
                         f"({shown}{'; ...' if len(problems) > 3 else ''}): remove or replace them")


@dataclass
class Datasets:
    train: ClassDataset
    val: ClassDataset | None
    num_classes: int


def build_datasets(cfg: DataConfig, img_size: int, num_classes: int, seed: int) -> Datasets:
    train: ClassDataset
    val: ClassDataset | None
    if cfg.dataset == "digits":
        train, val = DigitsDataset("train", img_size), DigitsDataset("val", img_size)
    elif cfg.dataset == "synthetic":
        classes = num_classes or 1000
        train = SyntheticDataset(cfg.synthetic_size, img_size, classes, seed)
        val = SyntheticDataset(max(256, cfg.synthetic_size // 8), img_size, classes, seed + 1)
    else:
        # cast: DataConfig.validate refuses --dataset folder without --data-dir
        train, val = _folders(Path(cast(str, cfg.data_dir)).resolve(), img_size)
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

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.start:])

    def __len__(self) -> int:
        return max(0, self.per_rank - self.start)


class PaddedEvalShard(Dataset):
    """This rank's evaluation samples, padded to whole batches; padding has valid=0."""

    def __init__(self, ds: ClassDataset, world: int, rank: int, batch_size: int):
        self.ds, self.indices = ds, list(range(rank, len(ds), world))
        self.padded = max(1, math.ceil(len(self.indices) / batch_size)) * batch_size

    def __len__(self) -> int:
        return self.padded

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        valid = i < len(self.indices)
        x, y = self.ds[self.indices[i] if valid else self.indices[0]]
        return x, torch.as_tensor(y), torch.tensor(1.0 if valid else 0.0)


def train_batches_per_epoch(n: int, world: int, batch_size: int) -> int:
    return (n // world) // batch_size


def _loader(ds: Dataset, batch_size: int, num_workers: int, sampler: Sampler[int] | None = None,
            collate: Collate | None = None) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, sampler=sampler, drop_last=True,
                      num_workers=num_workers, persistent_workers=False, collate_fn=collate,
                      pin_memory=False, prefetch_factor=4 if num_workers else None)


def train_loader(ds: ClassDataset, cfg: DataConfig, *, batch_size: int, accum: int, world: int, rank: int,
                 seed: int, epoch: int, start_batch: int = 0, collate: Collate | None = None) -> DataLoader:
    """Full optimizer steps only (batch x accum); starts after `start_batch` batches (resume).
    `collate`: how samples become a batch (augment.SoftTargetCollate: Mixup/CutMix on the host)."""
    sampler = ShardSampler(len(ds), world, rank, shuffle=True, seed=seed, epoch=epoch,
                           batch_size=batch_size * accum, start=start_batch * batch_size)
    return _loader(ds, batch_size, cfg.workers(), sampler, collate)


def eval_loader(ds: ClassDataset, cfg: DataConfig, *, batch_size: int, world: int, rank: int) -> DataLoader:
    return _loader(PaddedEvalShard(ds, world, rank, batch_size), batch_size, cfg.workers())


class _KeptError:
    """`loader` as torch_xla's loader thread iterates it, keeping the exception a fetch raised: that
    thread prints it and ends the epoch early, silently (measured: 10 of 16 batches, exit 0), and
    a sample's augmentation (timm, Pillow) can raise."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self.error: Exception | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        try:
            yield from self.loader
        except Exception as exc:
            self.error = exc
            raise


def to_device(loader: DataLoader, device: torch.device, batches_per_execution: int = 1) -> Iterator[Batch]:
    """Wrap a loader with MpDeviceLoader: background upload, and a graph boundary per batch. A batch
    the loader failed to make ends the iteration with a RunError naming the exception."""
    import torch_xla.distributed.parallel_loader as pl

    source = _KeptError(loader)
    batches = pl.MpDeviceLoader(source, device, batches_per_execution=batches_per_execution)
    yield from batches
    if source.error is not None:
        error = source.error
        raise RunError(f"the data loader failed to make a batch: {type(error).__name__}: "
                       f"{str(error).strip()[:200]} (its traceback is printed above)")
