"""torchrun entry point: `torchrun --standalone --nproc_per_node=N neuron_train/run.py [train options]`.

Thin on purpose: everything is `neuron-train train` (neuron_train/commands/train.py). Run as a
script, Python puts this file's own folder first on sys.path, where our subpackage names (common,
training, ops, ...) would shadow real top-level packages; replace it with the project root so
`neuron_train` imports as a package.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
sys.path.insert(0, os.path.dirname(_here))

from neuron_train.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
