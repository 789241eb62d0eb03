"""Configuration: file formats, precedence, validation at the edge, and the CLI's one-line errors."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from neuron_train.common.errors import UsageError
from neuron_train.training.config import RunConfig
from neuron_train.training.config_io import (
    add_config_arguments,
    build_config,
    config_from_args,
    config_to_argv,
    load_config_file,
)
from tests.conftest import ROOT, cpu_env


def parse(*argv: str) -> RunConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_defaults_are_the_digits_preset():
    cfg = parse()
    assert (cfg.model.name, cfg.data.dataset, cfg.model.img_size) == ("vit-digits", "digits", 32)


def test_yaml_and_toml_files_and_flags_override_them(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("train:\n  batch_size: 16\n  epochs: 2\noptim:\n  lr: 0.002\n")
    t = tmp_path / "run.toml"
    t.write_text("[train]\nbatch_size = 16\nepochs = 2\n[optim]\nlr = 2e-3\n")
    for f in (y, t):
        cfg = parse("--config", str(f), "--epochs", "5")
        assert (cfg.train.batch_size, cfg.train.epochs, cfg.optim.lr) == (16, 5, 0.002)


def test_argv_round_trip_reproduces_the_config():
    cfg = parse("--batch-size", "8", "--lr", "0.01", "--no-tensorboard", "--precision", "bf16-autocast")
    assert parse(*config_to_argv(cfg)) == cfg


def test_a_config_is_frozen_and_changed_only_by_replace():
    from dataclasses import FrozenInstanceError, replace

    cfg = parse("--resume", "--batch-size", "8")
    with pytest.raises(FrozenInstanceError):
        cfg.checkpoint.resume = None  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        cfg.checkpoint = replace(cfg.checkpoint, resume=None)  # type: ignore[misc]
    changed = replace(cfg, checkpoint=replace(cfg.checkpoint, resume=None))
    assert (changed.checkpoint.resume, cfg.checkpoint.resume) == (None, "latest")
    assert changed.train is cfg.train and changed.validate() == changed


@pytest.mark.parametrize("text, message", [
    ("model:\n  nme: x\n", "unknown key 'model.nme'"),
    ("modle:\n  name: x\n", "unknown section 'modle'"),
    ("train:\n  batch_size: many\n", "train.batch_size: expected int"),
    ("train:\n  precision: fp8\n", "train.precision must be one of"),
    ("train: [1, 2\n", "is not valid YAML"),
])
def test_bad_config_files_are_one_clear_error(tmp_path, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("[", r"\[")):
        build_config(load_config_file(str(f)), source=str(f))


@pytest.mark.parametrize("argv, message", [
    (["--lr", "-1"], "--lr must be > 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--dataset", "folder"], "--dataset folder needs --data-dir"),
    (["--data-dir", "/tmp"], "--data-dir is only used with --dataset folder"),
    (["--config", "/nonexistent.yaml"], "--config: no such file"),
    (["--require-precompiled"], "--require-precompiled needs --compile-cache"),
    (["--teacher-model", "vit-digits"], "--teacher-model needs --teacher-checkpoint"),
    (["--sift", "topk", "--sift-keep", "0.01", "--batch-size", "8"], "keeps no sample"),
    (["--batches-per-execution", "2"], "add --step-compiler lazy"),
])
def test_bad_values_rejected_at_the_edge(argv, message):
    with pytest.raises(UsageError, match=message):
        parse(*argv)


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["--lr", "-1"], "--lr must be > 0"),
    (["--img-size", "4"], "--img-size must be 8..4096"),
    (["--model", "no_such_model"], "unknown model 'no_such_model'"),
    (["--dataset", "folder", "--data-dir", "/nonexistent"], "no such directory"),
])
def test_cli_prints_one_line_and_exits_2(argv, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "neuron_train", "train", "--output-dir",
                           str(tmp_path / "run"), *argv], env=cpu_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_help_documents_every_contract_flag():
    proc = subprocess.run([sys.executable, str(ROOT / "neuron_train" / "run.py"), "--help"],
                          env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for flag in ("--config", "--model", "--img-size", "--num-classes", "--batch-size", "--dataset",
                 "--data-dir", "--epochs", "--max-steps", "--lr", "--precision", "--num-workers",
                 "--eval-every", "--checkpoint-every", "--resume", "--output-dir", "--seed",
                 "--teacher-model", "--sift", "--zero1", "--profile", "--compile-cache",
                 "--require-precompiled", "--check-graphs"):
        assert flag in proc.stdout, flag


@pytest.mark.parametrize("argv, workers", [
    ([], 0),                                                    # digits: in memory, no worker processes
    (["--dataset", "synthetic"], 0),
    (["--dataset", "folder", "--data-dir", str(ROOT)], 2),        # image decoding: worker processes
    (["--num-workers", "3"], 3),                                 # an explicit count is kept
    (["--dataset", "folder", "--data-dir", str(ROOT), "--num-workers", "0"], 0),
])
def test_data_workers_by_dataset_unless_given(argv, workers):
    assert parse(*argv).data.workers() == workers


def test_digits_are_upscaled_once_to_the_pixels_of_one_by_one_upscaling():
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    from neuron_train.training.data import DigitsDataset

    ds = DigitsDataset("train", 32)
    raw = torch.tensor(load_digits().images, dtype=torch.float32) / 16.0
    order = torch.randperm(len(raw), generator=torch.Generator().manual_seed(1234))[300:]  # the train split
    for i in (0, 7, len(ds) - 1):
        one = F.interpolate(raw[order[i]][None, None], size=(32, 32), mode="bilinear", align_corners=False)[0]
        image, label = ds[i]
        assert torch.equal(image, (one.expand(3, -1, -1) - 0.5) / 0.5)
        assert int(label) == load_digits().target[order[i]]


# --- the device-aware default step path (a pure function of the device kind: no device is faked) ---

def test_neuron_device_defaults_to_the_lazy_flat_path_and_cpu_to_dynamo_full(tmp_path):
    from neuron_train.training.config_io import save_config

    neuron, cpu = build_config(device_kind="NEURON"), build_config(device_kind="CPU")
    assert (neuron.train.step_compiler, neuron.optim.optimizer_impl) == ("lazy", "flat")
    assert (cpu.train.step_compiler, cpu.optim.optimizer_impl) == ("dynamo-full", "foreach")
    # the run's saved config holds what the default resolved to, and a relaunch elsewhere keeps it
    save_config(neuron, tmp_path / "config.yaml")
    saved = (tmp_path / "config.yaml").read_text()
    assert "step_compiler: lazy" in saved and "optimizer_impl: flat" in saved
    argv = config_to_argv(neuron)
    assert argv[argv.index("--step-compiler") + 1] == "lazy" and argv[argv.index("--optimizer-impl") + 1] == "flat"


@pytest.mark.parametrize("made_on, parsed_on", [("NEURON", "NEURON"), ("CPU", "NEURON"), ("NEURON", "CPU")])
def test_argv_reproduces_a_device_dependent_setting_on_any_device(made_on, parsed_on):
    """dynamo-full chosen on a Neuron device (or the CPU's default) is not Neuron's default: the
    flags must say it, or the run they launch (precompile's hint, bench's runs) trains lazy."""
    cfg = build_config(overrides={"train.step_compiler": "dynamo-full", "train.batch_size": 8}, device_kind=made_on)
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    overrides = {k: v for k, v in vars(parser.parse_args(config_to_argv(cfg))).items() if "." in k}
    assert build_config(overrides=overrides, device_kind=parsed_on) == cfg


def test_file_and_flags_override_the_device_default(tmp_path):
    flags = build_config(overrides={"train.step_compiler": "dynamo-full", "optim.optimizer_impl": "foreach"},
                         device_kind="NEURON")
    assert (flags.train.step_compiler, flags.optim.optimizer_impl) == ("dynamo-full", "foreach")
    from_file = build_config({"train": {"step_compiler": "dynamo"}}, device_kind="NEURON")
    assert (from_file.train.step_compiler, from_file.optim.optimizer_impl) == ("dynamo", "flat")


def test_help_names_the_default_of_each_device():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert helps["--step-compiler"].endswith("(default: dynamo-full on the CPU device; lazy on a Neuron device)")
    assert helps["--optimizer-impl"].endswith("(default: foreach on the CPU device; flat on a Neuron device)")
    assert helps["--lr"].endswith("(default: 0.001)")


def test_the_pjrt_device_is_the_users_else_this_machines():
    """bench_loop's children and prepare_environment take the device from here: PJRT_DEVICE wins,
    else a Neuron device when this machine has one (never a fixed CPU)."""
    from neuron_train.common.neuron_env import default_pjrt_device, neuron_device_present

    assert default_pjrt_device({"PJRT_DEVICE": "NEURON"}) == "NEURON"
    assert default_pjrt_device({"PJRT_DEVICE": "CPU"}) == "CPU"
    assert default_pjrt_device({}) == ("NEURON" if neuron_device_present() else "CPU")
    loop = (ROOT / "scripts" / "bench_loop.py").read_text()
    assert '"PJRT_DEVICE": _device()' in loop and 'get("PJRT_DEVICE", "CPU")' not in loop


def test_a_learning_rate_written_1e_3_in_yaml_is_a_number(tmp_path):
    """Weak row: YAML 1.1 (PyYAML) reads `lr: 1e-3` as the string '1e-3', which was refused."""
    from neuron_train.training.config_io import build_config, load_config_file

    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-3\n  weight_decay: 5E-2\nmodel:\n  name: vit-nano\n")
    cfg = build_config(load_config_file(str(path)), source=str(path))
    assert cfg.optim.lr == 1e-3 and cfg.optim.weight_decay == 0.05 and cfg.model.name == "vit-nano"
