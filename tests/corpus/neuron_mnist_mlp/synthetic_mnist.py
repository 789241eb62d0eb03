"""A stand-in for `torchvision.datasets.mnist` in the corpus copies of aws-neuron-samples' mnist_mlp
scripts (tests/corpus/SOURCES.md): no download at run time, a few hundred images, learnable.

Each class is a fixed random 28x28 on/off pattern (half the pixels on) plus noise, so the upstream scripts' own accuracy check
(eval.py asserts > 92%) still means something after a few epochs. `MNIST(root, train, download,
transform)` has the signature and item type (a uint8 image through `transform`, an int label) of
torchvision's class; `root` and `download` are accepted and unused.
"""

import numpy as np
import torch

TRAIN_SIZE = 1280  # a multiple of the scripts' batch size 32, as upstream's 60000 is
TEST_SIZE = 320    # upstream's 10000 is not (10000 % 32 == 16): see SOURCES.md


class MNIST(torch.utils.data.Dataset):

    def __init__(self, root=None, train=True, download=False, transform=None):
        patterns = (np.random.default_rng(0).random((10, 28, 28)) < 0.5) * 255.0
        rng = np.random.default_rng(1 if train else 2)
        count = TRAIN_SIZE if train else TEST_SIZE
        self.targets = rng.integers(0, 10, size=count)
        noise = rng.normal(0, 30, size=(count, 28, 28))
        self.data = np.clip(patterns[self.targets] + noise, 0, 255).astype(np.uint8)
        self.transform = transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        image = self.data[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])
