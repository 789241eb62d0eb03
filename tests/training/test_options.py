"""Training options checked against figures derived by hand: --pretrained (state dict, .safetensors
with another head), --optimizer sgd, --grad-clip, --grad-accum, --batches-per-execution, the masked
padding of evaluation, TensorBoard, the progress bar, a timm CNN and --precision xla-downcast-bf16.

Few runs, many assertions: each run below is shared by the tests after it. The data is an image
folder made here: solid colours (the same after a horizontal flip, so random flips cannot make two
runs differ), and a validation set of five copies of ONE image, one labelled cat and four dog. A
model must give all five the same prediction, so the right accuracy is 1/5 or 4/5; the evaluation
pads them to 8 with copies of the first sample, and counting that padding would give 4/8.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from neuron_train.training.config import DataConfig
from neuron_train.training.data import build_datasets
from neuron_train.training.models import create_model
from tests.conftest import NANO, run_train, summary_of

pytestmark = pytest.mark.slow  # the module's fixtures run training runs (run.py) in subprocesses

LR, CLIP = 0.5, 0.05
ONE_STEP_BY_HAND = ["--optimizer", "sgd", "--momentum", "0.9", "--weight-decay", "0", "--lr", str(LR),
                    "--warmup-steps", "0", "--schedule", "constant", "--grad-clip", str(CLIP),
                    "--max-steps", "2", "--eval-every", "100", "--log-every", "1"]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    from PIL import Image

    root = tmp_path_factory.mktemp("imgs")
    for cls, colour in (("cat", lambda i: (150 + 10 * i, 40, 30)), ("dog", lambda i: (30, 40, 150 + 10 * i))):
        (root / "train" / cls).mkdir(parents=True)
        for i in range(8):
            Image.new("RGB", (40, 30), colour(i)).save(root / "train" / cls / f"{i}.png")
    one = root / "one.png"
    Image.new("RGB", (40, 30), (120, 90, 60)).save(one)
    for cls, copies in (("cat", 1), ("dog", 4)):
        (root / "val" / cls).mkdir(parents=True)
        for i in range(copies):
            shutil.copy(one, root / "val" / cls / f"{i}.png")
    return root


def metrics(out: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def checkpoint(out: Path, step: int) -> dict:
    return torch.load(out / "checkpoints" / f"step-{step:08d}.pt", weights_only=True)


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def plain_and_accumulated(images, tmp_path_factory):
    """P: batch 8, two SGD steps from weights the test wrote, TensorBoard and the progress bar on.
    Q: the same steps as two micro-batches of 4 (--grad-accum 2), two batches per execution."""
    tmp = tmp_path_factory.mktemp("runs")
    torch.manual_seed(123)  # not the run's seed 0: weights the run could not have made itself
    init = create_model("vit-nano", num_classes=2, img_size=32).state_dict()
    torch.save(init, tmp / "init.pt")
    common = [*NANO, "--dataset", "folder", "--data-dir", str(images), "--pretrained", str(tmp / "init.pt"),
              *ONE_STEP_BY_HAND]
    plain = run_train(tmp / "plain", *common, "--batch-size", "8", "--checkpoint-every", "1",
                      "--tensorboard", "--progress")
    assert plain.returncode == 0, plain.stderr[-3000:]
    accum = run_train(tmp / "accum", *common, "--batch-size", "4", "--grad-accum", "2",
                      "--batches-per-execution", "2", "--step-compiler", "lazy", "--check-graphs")
    assert accum.returncode == 0, accum.stderr[-3000:]
    return init, (tmp / "plain", plain), (tmp / "accum", accum)


def test_sgd_moves_the_pretrained_weights_by_exactly_lr_times_the_clipped_norm(plain_and_accumulated):
    """SGD's first step is w1 = w0 - lr * g * min(1, clip / |g|): a change of norm lr * clip when
    clipping is active. A model not loaded from init.pt, or AdamW (a step of ~lr per weight), or no
    clipping (a change of lr * |g|) each give another norm."""
    init, (plain, _), _ = plain_and_accumulated
    (first, _) = metrics(plain, "train")
    assert first["lr"] == LR and first["grad_norm"] > 4 * CLIP  # the norm before clipping: clipping acts
    after = checkpoint(plain, 1)
    change = torch.cat([(after["model"][k] - init[k]).flatten() for k in init])
    assert change.norm().item() == pytest.approx(LR * CLIP, rel=1e-3)
    states = after["optimizer"]["state"].values()
    assert states and all(set(s) == {"momentum_buffer"} for s in states)  # torch.optim.SGD's state


def test_grad_accumulation_equals_one_step_of_the_whole_batch(plain_and_accumulated):
    _, (plain, _), (accum, _) = plain_and_accumulated
    # The gradient norm before clipping: equal only if the micro-batch gradients are averaged, not summed.
    norms = [(p["grad_norm"], a["grad_norm"]) for p, a in zip(metrics(plain, "train"), metrics(accum, "train"),
                                                                strict=True)]
    assert len(norms) == 2 and all(a == pytest.approx(p, rel=1e-4) for p, a in norms), norms
    assert largest_difference(checkpoint(accum, 2)["model"], checkpoint(plain, 2)["model"]) < 1e-5


def test_batches_per_execution_joins_micro_batches_into_fewer_executions(plain_and_accumulated):
    """Four micro-batches, two per execution: MpDeviceLoader cuts the graph when fetching batches
    1 and 3, and the evaluation's sync closes the last one: 3 executions instead of 4."""
    _, _, (accum, _) = plain_and_accumulated
    graphs = json.loads((accum / "graphs.json").read_text())
    assert graphs["source"] == "pt_xla_debug"  # executions counted from torch_xla's own log
    assert sum(g["executions"] for g in graphs["graphs"] if g["phase"] == "train") == 3


def test_evaluation_masks_the_padding_of_a_ragged_validation_set(plain_and_accumulated, images):
    _, (plain, _), _ = plain_and_accumulated
    model = create_model("vit-nano", num_classes=2, img_size=32)
    model.load_state_dict(checkpoint(plain, 2)["model"])
    model.eval()
    val = build_datasets(DataConfig(dataset="folder", data_dir=str(images)), 32, 0, 0).val
    x = torch.stack([val[i][0] for i in range(len(val))])
    y = torch.tensor([val[i][1] for i in range(len(val))])
    assert y.tolist() == [0, 1, 1, 1, 1]
    with torch.no_grad():
        logits = model(x)  # eager PyTorch on the CPU, not the XLA loop under test
    correct = (logits.argmax(-1) == y).sum().item()
    assert correct in (1, 4)  # one image, one prediction for all five
    (result,) = metrics(plain, "eval")
    assert result["eval_accuracy"] == correct / 5
    assert result["eval_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-4)


def test_tensorboard_event_files_hold_the_logged_scalars_and_the_bar_is_drawn(plain_and_accumulated):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, (plain, proc), _ = plain_and_accumulated
    assert list((plain / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard event file"
    events = EventAccumulator(str(plain / "tensorboard"))
    events.Reload()
    logged = metrics(plain, "train")
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in logged]
    (result,) = metrics(plain, "eval")
    assert [(e.step, e.value) for e in events.Scalars("eval/eval_accuracy")] == [
        (2, pytest.approx(result["eval_accuracy"], rel=1e-6))]
    # tqdm on stderr: the bar's last state, 2 of 2 steps, with a logged loss as postfix (the one the
    # step closures had delivered when the bar last moved).
    losses = "|".join(re.escape(f"{r['loss']:.4f}") for r in logged)
    assert re.search(rf"100%\|[^|]*\| 2/2 \[[^\]]*step[^\]]*loss=({losses})\]", proc.stderr), proc.stderr[-1500:]


def test_without_tensorboard_and_progress_neither_is_written(plain_and_accumulated):
    _, _, (accum, proc) = plain_and_accumulated
    assert not (accum / "tensorboard").exists() and not re.search(r"\d+/2 \[", proc.stderr)


# ----------------------------------------------------------------------------- a timm CNN


@pytest.fixture(scope="module")
def cnn_run(images, tmp_path_factory):
    """timm's test_resnet (a ResNet: no img_size argument) from .safetensors saved with a 10-class
    head for a 2-class dataset, trained one step under the legacy XLA_DOWNCAST_BF16 mode."""
    import timm
    from safetensors.torch import save_file

    tmp = tmp_path_factory.mktemp("cnn")
    torch.manual_seed(7)
    saved = {k: v.contiguous() for k, v in timm.create_model("test_resnet", num_classes=10).state_dict().items()}
    save_file(saved, str(tmp / "cnn.safetensors"))
    out = tmp / "run"
    proc = run_train(out, "--model", "test_resnet", "--dataset", "folder", "--data-dir", str(images),
                     "--batch-size", "8", "--max-steps", "1", "--lr", "1e-6", "--min-lr", "0", "--eval-every", "100",
                     "--pretrained", str(tmp / "cnn.safetensors"), "--precision", "xla-downcast-bf16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return saved, tmp / "cnn.safetensors", out, proc


def test_safetensors_weights_load_and_the_mismatched_head_is_named(cnn_run):
    import timm

    saved, path, out, proc = cnn_run
    fresh = timm.create_model("test_resnet", num_classes=2).state_dict()
    head = [k for k in saved if fresh[k].shape != saved[k].shape]
    assert head == ["fc.weight", "fc.bias"]
    (note,) = [line for line in proc.stdout.splitlines() if line.startswith(f"note: {path} ")]
    assert f" {len(head)} of this model's {len(fresh)} weights " in note
    assert note.endswith(f"left at random init: {', '.join(head)}"), note
    final = torch.load(next((out / "checkpoints").glob("*.pt")), weights_only=True)["model"]
    assert final["fc.weight"].shape == (2, fresh["fc.weight"].shape[1])
    params = [k for k in saved if k not in head and "running_" not in k and "num_batches" not in k]
    assert any(final[k].dim() == 4 for k in params)  # convolutions: a CNN went through the loop
    for k in params:  # loaded, then one step at LR 1e-6, in bf16
        assert (final[k] - saved[k]).abs().max().item() <= 2**-8 * saved[k].abs().max().item() + 1e-5, k


def test_xla_downcast_bf16_keeps_the_weights_in_bf16_on_the_device(cnn_run):
    """XLA_DOWNCAST_BF16 stores f32 tensors as bf16 on the device: every weight that comes back is a
    bf16 value, though the file's f32 weights mostly were not."""
    saved, _, out, _ = cnn_run
    assert summary_of(out)["precision"] == "xla-downcast-bf16" and summary_of(out)["model"] == "test_resnet"

    def in_bf16(t: torch.Tensor) -> bool:
        return torch.equal(t, t.bfloat16().float())

    assert not all(in_bf16(v) for v in saved.values() if v.is_floating_point())
    final = torch.load(next((out / "checkpoints").glob("*.pt")), weights_only=True)["model"]
    assert all(in_bf16(v) for v in final.values() if v.is_floating_point())
