"""`neuron-train train` / `torchrun neuron_train/run.py`: parse, build, train, print the summary."""

from __future__ import annotations

import argparse

from neuron_train.training.config import add_config_arguments, config_from_args


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Train a timm model with PyTorch/XLA: on NeuronCores when present, else on "
                          "the CPU XLA device. Launch several processes with torchrun.")
    add_config_arguments(parser)


def format_summary(s: dict) -> str:
    def num(key: str, fmt: str) -> str:
        return "n/a" if s.get(key) is None else format(s[key], fmt)

    lines = [
        f"run        {s['run_dir']}",
        f"model      {s['model']} ({s['params'] / 1e6:.2f} M params), {s['precision']}, "
        f"{s['device']} x {s['world_size']} rank(s), global batch {s['global_batch_size']}",
        f"steps      {s['steps']} ({s['epochs']} epochs), final loss {num('final_loss', '.4f')}",
        f"eval       accuracy {num('eval_accuracy', '.4f')}, loss {num('eval_loss', '.4f')}",
        f"speed      {num('samples_per_sec', '.1f')} samples/s, step {num('step_time_ms_median', '.1f')} ms "
        f"median (after {s['warmup_steps_excluded']} warm-up steps)",
        f"graphs     {s['compile_count']} compiled in {s['compile_time_s']:.1f} s",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    from neuron_train.training.device import init_backend, prepare_environment

    cfg.train.precision = prepare_environment(cfg.train.precision)
    from neuron_train.graphs import prepare_process

    prepare_process(check=cfg.compile.check_graphs)  # torch_xla reads its debug settings only once
    backend = init_backend()  # imports torch_xla: after the environment is set
    from neuron_train.training.loop import train

    try:
        summary = train(cfg, backend)
    finally:
        backend.close()
    if backend.is_main:
        print(format_summary(summary), flush=True)
    return 0
