"""timm's training recipe on XLA (training/augment.py, training/ema.py): each XLA-safety rule guarded.

The fast tests run in-process on the CPU XLA device and count compiled graphs with torch_xla's own
metric (CompileTime); each rule's test also runs the way the rule forbids and sees it recompile, so
the counter is shown able to catch it.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.debug.metrics as met

from neuron_train.common.errors import UsageError
from neuron_train.training.augment import AugmentedTensors, SoftTargetCollate, image_augment
from neuron_train.training.config import RecipeConfig, RunConfig, TrainConfig
from neuron_train.training.ema import ModelEma
from tests.conftest import cpu_env

CLASSES, BATCH, SIZE = 10, 8, 16
FULL = dict(mixup=0.8, cutmix=1.0, mixup_prob=0.7, smoothing=0.1)  # mixes some batches, not others


def compiles() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def samples(n: int = BATCH, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, SIZE, SIZE, generator=g), torch.tensor(i % CLASSES)) for i in range(n)]


def tiny_model(dev) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * SIZE * SIZE, CLASSES)).to(dev)


def train_steps(batches, *, on_device=None, model=None, after=None) -> list[int]:
    """SGD steps on `batches` (host tensors); the compile count after each step.

    `on_device(x, y)`: what a step does to the batch once it is on the device (the forbidden ways);
    `after()`: run after the optimizer step, before the step's sync.
    """
    dev = torch_xla.device()
    model = model if model is not None else tiny_model(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    counts = []
    for x, y in batches:
        x, y = x.to(dev), y.to(dev)
        if on_device is not None:
            x, y = on_device(x, y)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if after is not None:
            after()
        torch_xla.sync()
        counts.append(compiles())
    return counts


def steady(counts: list[int], warm: int = 2) -> bool:
    return counts[warm:] == [counts[warm]] * (len(counts) - warm)


# ----- soft targets: the same values as timm's losses ----------------------------------------

def test_cross_entropy_on_soft_targets_equals_timms_losses():
    from timm.data import Mixup
    from timm.data.mixup import mixup_target
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

    np.random.seed(0)
    logits = torch.randn(BATCH, CLASSES)
    labels = torch.arange(BATCH) % CLASSES
    smooth = mixup_target(labels, CLASSES, smoothing=0.1)
    assert torch.allclose(F.cross_entropy(logits, smooth), LabelSmoothingCrossEntropy(0.1)(logits, labels))
    x = torch.randn(BATCH, 3, SIZE, SIZE)
    _, soft = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=CLASSES)(x, labels)
    assert torch.allclose(F.cross_entropy(logits, soft), SoftTargetCrossEntropy()(logits, soft))
    assert torch.allclose(F.cross_entropy(logits, soft, reduction="none").mean(),
                          SoftTargetCrossEntropy()(logits, soft))


def test_every_batch_has_the_same_target_shape_mixed_or_not():
    np.random.seed(0)
    collate = SoftTargetCollate(RecipeConfig(**FULL), CLASSES)
    kinds = {tuple(collate(samples(seed=s))[1].shape) + (collate(samples(seed=s))[1].dtype,) for s in range(30)}
    assert kinds == {(BATCH, CLASSES, torch.float32)}


# ----- a resumed run mixes as the uninterrupted one did ---------------------------------------

def mixed(collate, seeds) -> list:
    """Batches of samples(seed=s) through `collate`; numpy's global generator is drawn from between
    batches, as the loader's thread collating ahead of the step, or any library, may do."""
    out = []
    for s in seeds:
        out.append(collate(samples(seed=s)))
        np.random.rand(7)
    return out


def test_a_resumed_epoch_mixes_its_batches_as_the_uninterrupted_epoch_did():
    np.random.seed(0)
    collate = SoftTargetCollate(RecipeConfig(**FULL), CLASSES, seed=3)
    full = mixed(collate.at(rank=0, epoch=1, first_batch=0), range(6))
    np.random.seed(0)  # a resume re-seeds numpy (loop.py): the draws must not depend on it
    resumed = mixed(collate.at(rank=0, epoch=1, first_batch=3), range(3, 6))
    for (x, t), (rx, rt) in zip(full[3:], resumed, strict=True):
        assert torch.equal(x, rx) and torch.equal(t, rt)
    draws = {tuple(t.max(1).values.tolist()) for _, t in full}
    assert len(draws) > 2, "every batch mixed alike: the draw ignores the batch"
    other_rank = collate.at(rank=1, epoch=1, first_batch=0)(samples(seed=0))[1]
    other_epoch = collate.at(rank=0, epoch=2, first_batch=0)(samples(seed=0))[1]
    assert not torch.equal(other_rank, full[0][1]) and not torch.equal(other_epoch, full[0][1])


def test_mixing_leaves_numpys_global_generator_where_it_was():
    np.random.seed(5)
    expected = np.random.rand(3)
    np.random.seed(5)
    SoftTargetCollate(RecipeConfig(**FULL), CLASSES).at(rank=0, epoch=0, first_batch=0)(samples())
    assert np.array_equal(np.random.rand(3), expected)


# ----- Mixup / CutMix: on the host, never a slice or a constant on the device -----------------

def test_mixing_on_the_host_compiles_no_graph_after_warm_up():
    np.random.seed(0)
    collate = SoftTargetCollate(RecipeConfig(**FULL), CLASSES)
    counts = train_steps([collate(samples(seed=s)) for s in range(8)])
    assert steady(counts), f"compiles after each step: {counts}"


def test_timms_cutmix_on_the_device_recompiles_each_step():
    """The rule's other side: timm's stock Mixup on device tensors cuts a box of a new shape."""
    from timm.data import Mixup

    np.random.seed(0)
    mix = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=CLASSES)
    counts = train_steps([(x, y) for x, y in (torch.utils.data.default_collate(samples(seed=s))
                                              for s in range(8))], on_device=mix)
    assert len(set(counts[2:])) >= 4, f"stock CutMix on the device stayed stable?: {counts}"


def test_a_mixing_weight_baked_in_as_a_python_float_recompiles_at_1():
    """Why the weight never reaches the device as a Python number: lam == 1 (an unmixed batch) is a
    graph constant of its own. Our collate hands the device only tensors (tested above)."""
    lams = iter([0.3, 0.6, 0.4, 1.0, 0.7, 0.5])

    def mix(x, y):
        lam = next(lams)
        return x * lam + x.flip(0) * (1 - lam), y

    counts = train_steps([torch.utils.data.default_collate(samples(seed=s)) for s in range(6)], on_device=mix)
    assert not steady(counts), counts


# ----- image policies and random erasing: host only, fixed shapes ----------------------------

def test_randaugment_and_random_erasing_run_on_host_tensors_of_one_shape():
    recipe = RecipeConfig(aa="rand-m9-mstd0.5-inc1", reprob=1.0)
    aug = image_augment(recipe, SIZE, (0.5,) * 3, (0.5,) * 3)
    base = [(torch.rand(3, SIZE, SIZE) * 2 - 1, torch.tensor(1)) for _ in range(40)]

    class Base(list):
        num_classes = CLASSES

    ds = AugmentedTensors(Base(base), aug, (0.5,) * 3, (0.5,) * 3)
    out = [ds[i][0] for i in range(len(base))]
    assert {(t.device.type, tuple(t.shape), t.dtype) for t in out} == {("cpu", (3, SIZE, SIZE), torch.float32)}
    assert all(not torch.equal(o, b) for o, (b, _) in zip(out, base, strict=True))  # reprob 1: every one erased


def test_a_samples_augmentation_depends_on_seed_epoch_and_index_alone():
    """timm draws from the global generators, which the step's thread moves too (torch.compile puts
    Python's and torch's states back after each compile): each sample seeds them for its own draws,
    and puts them back for everyone else."""
    import random

    import numpy as np

    recipe = RecipeConfig(aa="rand-m9-mstd0.5-inc1", reprob=0.5)
    aug = image_augment(recipe, SIZE, (0.5,) * 3, (0.5,) * 3)

    class Base(list):
        num_classes = CLASSES

    base = Base([(torch.rand(3, SIZE, SIZE) * 2 - 1, torch.tensor(1)) for _ in range(8)])
    ds = AugmentedTensors(base, aug, (0.5,) * 3, (0.5,) * 3, seed=7)
    first = [ds.at(1)[i][0] for i in range(8)]
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # another thread moved them meanwhile
    assert all(torch.equal(a, ds.at(1)[i][0]) for i, a in enumerate(first))
    assert not all(torch.equal(a, ds.at(2)[i][0]) for i, a in enumerate(first)), "another epoch, the same draws"
    assert not all(torch.equal(a, AugmentedTensors(base, aug, (0.5,) * 3, (0.5,) * 3, seed=8).at(1)[i][0])
                   for i, a in enumerate(first)), "another seed, the same draws"
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    ds.at(1)[0]
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == (
        random.seed(5) or random.random(), np.random.seed(5) or np.random.rand(),
        torch.manual_seed(5) and torch.rand(1).item()), "the global generators' states were not put back"


def test_randaugment_at_magnitude_10_posterizes_to_black_instead_of_killing_the_loader():
    from PIL import Image

    aug = image_augment(RecipeConfig(aa="rand-m10-n1-inc1"), SIZE, (0.5,) * 3, (0.5,) * 3)
    ops = aug.policy.transforms[0].ops
    posterize = next(op for op in ops if op.name == "PosterizeIncreasing")
    img = Image.new("RGB", (SIZE, SIZE), (200, 100, 50))
    assert posterize.aug_fn(img, 0).getextrema() == ((0, 0),) * 3


def test_a_policy_timm_does_not_know_is_one_line():
    with pytest.raises(UsageError, match="--aa rand-x9: not a policy timm knows"):
        RecipeConfig(aa="rand-x9").validate()


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_numpy_cannot_take_is_refused_before_the_loader_meets_it(seed):
    cfg = RunConfig(train=TrainConfig(seed=seed))
    with pytest.raises(UsageError, match=r"--seed must be in \[0, 2\*\*32\)"):
        cfg.validate()


def test_mixing_an_odd_batch_is_refused():
    cfg = RunConfig(recipe=RecipeConfig(cutmix=1.0), train=TrainConfig(batch_size=7))
    with pytest.raises(UsageError, match="--batch-size must be even"):
        cfg.validate()


# ----- EMA: in the step's graph, no host read, evaluated with the raw model's graphs ---------

def test_ema_update_adds_no_graph_and_no_host_read_per_step():
    from timm.utils import ModelEmaV3

    dev = torch_xla.device()
    host = tiny_model("cpu")
    start = {k: v.clone() for k, v in host.state_dict().items()}
    ema = ModelEmaV3(host, decay=0.9, stochastic_rounding=False)  # made on the host (ema.py)
    model = host.to(dev)
    ema.module.to(dev)
    averages = ModelEma(ema, model)
    reads = met.metric_data("TransferFromDeviceTime")
    before = reads[0] if reads else 0
    counts = train_steps([torch.utils.data.default_collate(samples(seed=s)) for s in range(6)],
                         model=model, after=averages.update)
    reads = met.metric_data("TransferFromDeviceTime")
    assert steady(counts), counts
    assert (reads[0] if reads else 0) == before, "the EMA update read a device value"
    moved = {k: v.cpu() for k, v in averages.module().state_dict().items()}
    assert any(not torch.allclose(moved[k], v) for k, v in start.items()), "the EMA never moved"


def test_ema_values_equal_timms_update():
    import copy

    from timm.utils import ModelEmaV3

    dev = torch_xla.device()
    host = tiny_model("cpu")
    theirs, ours = ModelEmaV3(host, decay=0.75), ModelEmaV3(host, decay=0.75)
    model = copy.deepcopy(host).to(dev)
    ours.module.to(dev)
    averages = ModelEma(ours, model)  # starts at the model's weights, as timm's does when made
    for shift in (1.0, -3.0):  # two steps: the second averages the first's average
        with torch.no_grad():
            for p in (*host.parameters(), *model.parameters()):
                p.add_(shift)
        theirs.update(host)  # timm, on the host
        averages.update()
        torch_xla.sync()
    mine = averages.module().state_dict()
    for k, v in theirs.module.state_dict().items():
        assert torch.allclose(mine[k].cpu(), v), k


def test_evaluating_the_ema_weights_reuses_the_raw_models_eval_graph():
    from timm.utils import ModelEmaV3

    dev = torch_xla.device()
    host = tiny_model("cpu")
    ema = ModelEmaV3(host, decay=0.9)
    model = host.to(dev).eval()
    ema.module.to(dev)
    averages = ModelEma(ema, model)
    averages.update()
    torch_xla.sync()
    x = torch.randn(BATCH, 3, SIZE, SIZE).to(dev)
    with torch.no_grad():
        raw = model(x).argmax(-1).sum()
        torch_xla.sync()
        after_raw = compiles()
        averaged = averages.module()(x).argmax(-1).sum()
        torch_xla.sync()
    assert after_raw > 0 and compiles() == after_raw, (raw, averaged)


def test_a_float32_ema_of_a_bf16_model_is_evaluated_in_bf16_and_saved_in_float32():
    """--precision bf16 keeps a float32 EMA (bf16 would round its small steps away). Evaluated, it
    takes the model's bf16 inputs on the raw model's eval graph; saved, it keeps float32. (Evaluated
    in float32, bf16 images met float32 layers: "Input type (c10::BFloat16) and bias type (float)
    should be the same", a traceback at the first evaluation.)"""
    from timm.utils import ModelEmaV3

    dev = torch_xla.device()
    host = tiny_model("cpu").to(torch.bfloat16)
    ema = ModelEmaV3(host, decay=0.9, stochastic_rounding=False, dtype=torch.float32)
    model = host.to(dev).eval()
    ema.module.to(dev)
    averages = ModelEma(ema, model)
    averages.update()
    torch_xla.sync()
    x = torch.randn(BATCH, 3, SIZE, SIZE).to(torch.bfloat16).to(dev)
    with torch.no_grad():
        raw = model(x).argmax(-1).sum()  # kept: a result nobody holds is not computed at the sync
        torch_xla.sync()
        after_raw = compiles()
        averaged = averages.module()(x).argmax(-1).sum()
        torch_xla.sync()
    assert after_raw > 0 and compiles() == after_raw, (raw, averaged)
    assert {t.dtype for t in averages.state_dict().values() if t.is_floating_point()} == {torch.float32}


# The EMA as the loop builds it (build_ema, then ModelEma on the device) of weights 1.0 moving to 2.0:
# at decay 0.9998 each update adds 2e-4, below half a bf16 ulp at 1.0 (2^-8): in bf16 it never moves.
_EMA_MOVES = """
import torch, torch_xla
from neuron_train.training.config_io import build_config
from neuron_train.training.ema import ModelEma, build_ema
cfg = build_config({"train": {"precision": "xla-downcast-bf16"}, "recipe": {"model_ema": True}})
host = torch.nn.Linear(4, 4)
with torch.no_grad():
    for p in host.parameters():
        p.fill_(1.0)
timm_ema = build_ema(cfg, host)
model = host.to(torch_xla.device())
timm_ema.module.to(torch_xla.device())
ema = ModelEma(timm_ema, model)
with torch.no_grad():
    for p in model.parameters():
        p.fill_(2.0)
for _ in range(10):
    ema.update()
    torch_xla.sync()
print("AVERAGE", ema.state_dict()["weight"].double().mean().item())
"""


@pytest.mark.slow  # a torch process of its own: XLA_DOWNCAST_BF16 is read when torch_xla starts
def test_the_ema_moves_under_xla_downcast_bf16():
    """XLA_DOWNCAST_BF16 makes a float32 tensor bf16 on the device (a float32 EMA stayed at 1.0 here);
    the EMA is float64 there, float32 on the device: 10 updates of 2e-4 move it by 2e-3."""
    proc = subprocess.run([sys.executable, "-c", _EMA_MOVES], env=cpu_env(XLA_DOWNCAST_BF16="1"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    average = float(proc.stdout.split("AVERAGE")[1])
    assert 1.0015 < average < 1.0025, average  # 1 + 10 * 2e-4, within float32 rounding


def test_model_ema_is_refused_under_xla_use_bf16_by_flag_and_by_environment(monkeypatch):
    """XLA_USE_BF16 makes float64 bf16 too: no dtype keeps the average moving."""
    from neuron_train.training.config_io import build_config
    from neuron_train.training.device import resolve_precision

    with pytest.raises(UsageError, match="--model-ema with --precision xla-use-bf16.*does not move"):
        build_config({"train": {"precision": "xla-use-bf16"}, "recipe": {"model_ema": True}})
    build_config({"train": {"precision": "xla-downcast-bf16"}, "recipe": {"model_ema": True}})  # kept: it moves
    cfg = build_config({"recipe": {"model_ema": True}})
    monkeypatch.setenv("XLA_USE_BF16", "1")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    with pytest.raises(UsageError, match="--model-ema with --precision xla-use-bf16"):
        resolve_precision(cfg)


# ----- the flags: train options, so bench and plan take them and hand them on ----------------

@pytest.mark.parametrize("command", ["bench", "plan", "precompile"])
def test_bench_plan_and_precompile_take_the_recipe_flags_and_hand_them_on(command):
    import argparse

    from neuron_train.commands import bench, plan
    from neuron_train.training.config_io import config_from_args, config_from_train_args, config_to_argv

    flags = ["--model", "vit-nano", "--aa", "rand-m9-mstd0.5-inc1", "--reprob", "0.25", "--mixup", "0.8",
             "--cutmix", "1.0", "--mixup-prob", "0.9", "--mixup-switch-prob", "0.4", "--smoothing", "0.1",
             "--model-ema", "--model-ema-decay", "0.999"]
    if command == "precompile":  # `precompile [options] -- TRAIN_ARGS`
        cfg = config_from_train_args(flags, prog="neuron-train precompile [options] --")
    else:
        parser = argparse.ArgumentParser()
        {"bench": bench.configure_parser, "plan": plan.configure_parser}[command](parser)
        cfg = config_from_args(parser.parse_args([*flags, "--output", "result.json"]))
    assert (cfg.recipe.aa, cfg.recipe.cutmix, cfg.recipe.model_ema, cfg.recipe.model_ema_decay) == (
        "rand-m9-mstd0.5-inc1", 1.0, True, 0.999)
    device_dependent = ["--optimizer-impl", cfg.optim.optimizer_impl, "--step-compiler", cfg.train.step_compiler]
    assert config_to_argv(cfg) == flags[:2] + device_dependent + flags[2:]  # in the sections' order


def test_a_config_files_recipe_section_holds_the_same_keys():
    from neuron_train.training.config_io import build_config

    cfg = build_config({"recipe": {"aa": "original", "cutmix": 1, "smoothing": 0.1, "model_ema": True}})
    assert (cfg.recipe.aa, cfg.recipe.cutmix, cfg.recipe.smoothing,
            cfg.recipe.model_ema) == ("original", 1.0, 0.1, True)
    with pytest.raises(UsageError, match="--smoothing must be in"):
        build_config({"recipe": {"smoothing": 1.5}})


def test_another_ema_decay_is_the_same_graph():
    """The decay is data, not a graph constant: precompile need not record it (config.py)."""
    from timm.utils import ModelEmaV3

    dev = torch_xla.device()
    counts = []
    for decay in (0.9, 0.99, 0.999):
        host = tiny_model("cpu")
        ema = ModelEmaV3(host, decay=decay, stochastic_rounding=False)
        model = host.to(dev)
        ema.module.to(dev)
        ModelEma(ema, model).update()
        torch_xla.sync()
        counts.append(compiles())
    assert counts == [counts[0]] * 3, counts


def test_a_run_with_the_recipe_against_a_manifest_without_it_names_the_recipe():
    from neuron_train.precompile.coverage import differences
    from neuron_train.training.cache_hook import config_labels, graph_config
    from neuron_train.training.config_io import build_config

    def config(recipe: dict) -> dict:
        return graph_config(build_config({"recipe": recipe}), world_size=1, num_classes=10, device="CPU",
                            env={}, versions={"torch": "2.9.0"})

    assert differences(config({"cutmix": 1.0, "model_ema": True}), config({}), config_labels()) == [
        "soft targets (--mixup, --cutmix, --smoothing) on here, (none) in the manifest",
        "model EMA on here, (none) in the manifest"]
    assert differences(config({"smoothing": 0.1, "aa": "original", "reprob": 0.5}), config({"mixup": 0.8}),
                       config_labels()) == []  # host-side settings; any soft targets are one graph


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loader thread's, by design
def test_a_batch_the_loader_fails_to_make_stops_the_epoch_with_one_line_not_silently():
    """torch_xla's loader thread prints a fetch's exception and ends the epoch early; an augmentation
    that raises on one sample (timm with a newer Pillow did) must not shorten training unnoticed."""
    from torch.utils.data import DataLoader

    from neuron_train.common.errors import RunError
    from neuron_train.training.data import to_device

    class Failing(list):
        def __getitem__(self, i):
            if i == 40:
                raise ValueError("bits must be between or equal to 1 and 8")
            return super().__getitem__(i)

    loader = DataLoader(Failing(samples(64)), batch_size=4)
    seen = []
    with pytest.raises(RunError, match=r"the data loader failed to make a batch: ValueError: bits must be"):
        for x, _ in to_device(loader, torch_xla.device()):
            seen.append(x.shape[0])
    assert len(seen) == 10  # the batches before the failing one were trained on
