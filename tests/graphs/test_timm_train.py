"""timm's own train.py on XLA, with the changes docs/guide.md §3 lists, judged by check-graphs.

timm's train.py is not in the timm package the registry serves (neither its wheel nor its sdist
holds it), so the test needs a copy from pytorch-image-models: TIMM_TRAIN_PY=/path/to/train.py. The
changed copy is made in the test's tmp directory and never committed; a change that no longer
applies to that train.py fails the test, naming the line it looked for.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cpu_env

TIMM_TRAIN = Path(os.environ.get("TIMM_TRAIN_PY", "/nonexistent"))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not TIMM_TRAIN.is_file(), reason="timm's train.py is not in the timm package: set TIMM_TRAIN_PY to "
    "pytorch-image-models' train.py")]

# (timm's line, the line(s) a timm user writes instead): the whole port to XLA
XLA_CHANGES = [
    ("        losses_m.update(loss.item() * accum_steps, batch_size)\n",
     "        torch_xla.sync()  # XLA: cut the step's graph here (or it grows every step), then read the loss\n"
     "        losses_m.update(loss.item() * accum_steps, batch_size)\n"),
    ("    with torch.inference_mode():\n",
     "    with torch.no_grad():  # XLA: an inference tensor has no version counter\n"),
    ("import torch\n", "import torch\nimport torch_xla\n"),
]


def xla_copy(dest: Path) -> Path:
    text = TIMM_TRAIN.read_text()
    for old, new in XLA_CHANGES:
        assert old in text, f"{TIMM_TRAIN} no longer has {old.strip()!r}: update XLA_CHANGES and guide §3"
        text = text.replace(old, new, 1)
    dest.write_text(text)
    return dest


def image_folder(root: Path) -> Path:
    from PIL import Image

    for split, n in (("train", 16), ("validation", 8)):
        for c, colour in enumerate(((200, 30, 30), (30, 30, 200))):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (32, 32), tuple(v + 3 * i for v in colour)).save(folder / f"{i}.png")
    return root


def test_timms_train_py_with_the_documented_changes_is_graph_stable(tmp_path):
    script = xla_copy(tmp_path / "train_xla.py")
    data = image_folder(tmp_path / "data")
    cmd = [sys.executable, "-m", "neuron_train", "check-graphs", "--", sys.executable, str(script),
           "--data-dir", str(data), "--device", "xla", "--model", "vit_tiny_patch16_224",
           "--model-kwargs", "img_size=32", "patch_size=8", "depth=1", "embed_dim=32", "num_heads=2",
           "--img-size", "32", "--num-classes", "2", "-b", "8", "--epochs", "2", "--workers", "0",
           "--no-prefetcher", "--opt", "sgd", "--lr", "0.01", "--warmup-epochs", "0",
           "--output", str(tmp_path / "out"), "--log-interval", "1"]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "verdict: graph-stable" in proc.stdout, proc.stdout[-4000:]
