"""The reference study's training script, written from its description (issue 23): timm
`VisionTransformer()` with its defaults (ViT-Base/16, 224 px, 1000 classes), a dataset that draws
a fresh `torch.randn(3, 224, 224)` image per sample, batch 16, a DataLoader with 4 workers wrapped
in MpDeviceLoader, Adam, `xm.optimizer_step`, `init_process_group('xla')`, launched by torchrun on
all NeuronCores with XLA_USE_BF16=1:

    XLA_USE_BF16=1 torchrun --standalone --nproc_per_node=32 scripts/study_vit_train.py

and, before renting anything, the plan for it (docs/plan.md):

    XLA_USE_BF16=1 neuron-train plan --steps 3 --epoch-samples 100000 -- \
        torchrun --standalone --nproc_per_node=1 scripts/study_vit_train.py

Options are sizes only: --steps (per epoch), --epochs, --batch-size, --workers, --img-size.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.xla_backend  # noqa: F401  (registers the 'xla' process-group backend)
from timm.models.vision_transformer import VisionTransformer


class RandomImages(torch.utils.data.Dataset):
    """A fresh random image per sample, as the study's dataset: the host pays for each one."""

    def __init__(self, samples: int, img_size: int, classes: int = 1000):
        self.samples, self.img_size, self.classes = samples, img_size, classes

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int):
        return torch.randn(3, self.img_size, self.img_size), i % self.classes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--img-size", type=int, default=224)
    args = parser.parse_args()

    dist.init_process_group("xla", init_method="xla://")
    device = torch_xla.device()
    model = VisionTransformer(img_size=args.img_size).to(device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    data = RandomImages(args.steps * args.batch_size * dist.get_world_size(), args.img_size)
    sampler = torch.utils.data.distributed.DistributedSampler(data, dist.get_world_size(), dist.get_rank())
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, sampler=sampler,
                                         num_workers=args.workers, drop_last=True)
    for epoch in range(args.epochs):
        start, steps = time.perf_counter(), 0
        for images, labels in pl.MpDeviceLoader(loader, device):
            optimizer.zero_grad()
            loss = loss_fn(model(images), labels)
            loss.backward()
            xm.optimizer_step(optimizer)  # all-reduces the gradients over the ranks, then steps
            steps += 1
        rate = steps * args.batch_size * dist.get_world_size() / (time.perf_counter() - start)
        xm.master_print(f"epoch {epoch}: {rate:.1f} samples/s")


if __name__ == "__main__":
    main()
