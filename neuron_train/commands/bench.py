"""`neuron-train bench`: measure this machine on one model and write one result file.

`train` mode runs our training loop (`neuron_train/run.py`, under torchrun for several processes)
and reads its summary.json; `infer` mode times a compiled forward pass (the CPU XLA device, or
`torch_neuronx.trace` / `torch_neuron` tracing on Neuron hardware). Warm-up steps and compile time
are kept out of the throughput figures and reported apart. The result file format is versioned and
documented in docs/bench.md; `validate_result` is the one check of it that `report` also uses.

The command parses and checks its options and runs the steps; the steps are library code in cost/bench/:
`instance` (where: EC2 instance type, host), `sweep` (what is measured, and repeated), `measure`
(one measurement), `script_bench` (a COMMAND's), `result` (the result file).
"""

from __future__ import annotations

import argparse
import functools
import shlex
from dataclasses import replace

from neuron_train.common.errors import UsageError
from neuron_train.common.fileio import new_output
from neuron_train.common.writer import Target
from neuron_train.cost.bench import script_bench
from neuron_train.cost.bench.instance import check_mode_fits, resolve_instance_type
from neuron_train.cost.bench.result import build_result, loop_workload, workload_facts, write_result
from neuron_train.cost.bench.sweep import (
    DEFAULT_MEASURED_STEPS,
    DEFAULT_SWEEP_BATCH_SIZES,
    SweepPlan,
    measure_loop,
)
from neuron_train.cost.records import BenchResult
from neuron_train.cost.schema import MODES, validate_result
from neuron_train.instrument.script import checked_command
from neuron_train.training.config import RunConfig
from neuron_train.training.config_io import add_config_arguments, config_from_args, config_to_argv


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return sorted(set(values))


# --- the command ---------------------------------------------------------------------------------

def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.usage = ("neuron-train bench --mode train|infer [options] [TRAIN OPTIONS] --output FILE.json\n"
                    "       neuron-train bench [--samples-per-step N] [--steps N] [options] --output FILE.json "
                    "-- COMMAND [ARGS...]")
    parser.description = ("Benchmark the configured model on this machine (train: our training loop; "
                          "infer: a compiled forward pass), or any PyTorch/XLA training COMMAND given after "
                          "--, and write one result file for 'neuron-train report'. Takes every train option.")
    g = parser.add_argument_group("bench options")
    g.add_argument("--mode", choices=MODES, help="what to measure (required without a COMMAND; with one, "
                   "what it does: default train)")
    g.add_argument("--output", required=True, metavar="FILE.json", help="result file to write")
    g.add_argument("--instance-type", metavar="TYPE",
                   help="instance type to record when the EC2 metadata service is unreachable "
                        "(default: detected on EC2, else 'local')")
    g.add_argument("--repeats", type=int, help="measurements of the chosen configuration; the result gives "
                   "their median and spread (default: 3; 1 for a COMMAND, which runs again for each)")
    g.add_argument("--nproc", type=int, default=1,
                   help="train: data-parallel processes, one per NeuronCore (default: 1)")
    g.add_argument("--sweep", action="store_true",
                   help="try batch sizes x process counts, keep the fastest; failures and "
                        "out-of-memory are recorded, not fatal")
    g.add_argument("--sweep-batch-sizes", type=_int_list, metavar="B1,B2,..",
                   help="per-device batch sizes for --sweep (default: 8,16,32,64,128,256)")
    g.add_argument("--sweep-nprocs", type=_int_list, default=None, metavar="N1,N2,..",
                   help="process counts for --sweep in train mode (default: --nproc)")
    g.add_argument("--force", action="store_true", help="replace an existing --output file (checked "
                   "before measuring; the file is replaced whole, once the result is complete)")
    c = parser.add_argument_group("a COMMAND's options (docs/bench.md: Bring your own script)")
    c.add_argument("--samples-per-step", type=int, metavar="N", help="samples one process's step trains on "
                   "(default: the leading dimension of the input batch each step copies to the device)")
    c.add_argument("--steps", type=int, default=script_bench.DEFAULT_STEPS, metavar="N",
                   help=f"steady steps to measure before the command is stopped (default "
                   f"{script_bench.DEFAULT_STEPS}; 0: run it to its end)")
    c.add_argument("--workload", metavar="NAME", help="the name the report groups the result under "
                   "(default: the script's file name)")
    c.add_argument("--train-samples", type=int, metavar="N", help="samples in one epoch of the script's "
                   "data, for the report's cost per epoch (default: not known, not shown)")
    add_config_arguments(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: a training command to measure")


def _plan(args: argparse.Namespace, cfg: RunConfig) -> SweepPlan:
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
    if not args.sweep and (args.sweep_batch_sizes or args.sweep_nprocs):
        raise UsageError("--sweep-batch-sizes / --sweep-nprocs need --sweep")
    nprocs = args.sweep_nprocs or [args.nproc]
    if args.mode == "infer" and nprocs != [1]:
        raise UsageError("infer mode runs in one process: drop --nproc / --sweep-nprocs")
    batch_sizes = ((args.sweep_batch_sizes or list(DEFAULT_SWEEP_BATCH_SIZES)) if args.sweep
                   else [cfg.train.batch_size])
    return SweepPlan(args.mode, batch_sizes, nprocs, args.repeats)


def _script_command(args: argparse.Namespace) -> list[str] | None:
    """The COMMAND after `--`, or None (our loop); refused with options that only fit our loop."""
    if not args.command:
        if args.mode is None:
            raise UsageError("--mode train|infer is required (or give a training command after --)")
        return None
    command = checked_command(args.command, "neuron-train bench [options] --output FILE.json -- COMMAND")
    if args.nproc != 1 or args.sweep or args.sweep_batch_sizes or args.sweep_nprocs:
        raise UsageError("--nproc and --sweep are for neuron-train's own loop: a COMMAND starts its own "
                         "processes (e.g. `-- torchrun --standalone --nproc_per_node=W my_train.py`) and batch size")
    if getattr(args, "config", None) or any("." in key for key in vars(args)):  # unset train flags are absent
        raise UsageError("train options (--model, --batch-size, --config, ...) describe neuron-train's own "
                         "loop: a COMMAND is measured as it runs; drop them")
    for flag, value, low in (("--samples-per-step", args.samples_per_step, 1), ("--steps", args.steps, 0),
                             ("--train-samples", args.train_samples, 1)):
        if value is not None and value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")
    return command


def _main_script(args: argparse.Namespace, command: list[str], output: Target) -> int:
    repeats = args.repeats or 1
    if repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {repeats}")
    instance = resolve_instance_type(args.instance_type)
    mode = args.mode or "train"
    check_mode_fits(mode, instance[0])
    figures = []
    for i in range(repeats):
        figures.append(script_bench.measure_command(command, steps=args.steps, samples_flag=args.samples_per_step,
                                                    echo=True))
        print(f"bench: run {i + 1} of {repeats}: {script_bench.describe(figures[-1])}", flush=True)
    workload = script_bench.script_workload(command, figures[0], name=args.workload,
                                            train_samples=args.train_samples)
    line = shlex.join(["neuron-train", "bench", "--mode", mode, "--steps", str(args.steps), "--repeats",
                       str(repeats), *(["--samples-per-step", str(args.samples_per_step)]
                                       if args.samples_per_step else []), "--", *command])
    result = build_result(workload=workload, mode=mode, instance=instance,
                          runs=[script_bench.to_measurement(f) for f in figures], sweep_rows=None,
                          warmup=figures[0].warmup_steps, command=line)
    return _finish(result, output)


def main(args: argparse.Namespace) -> int:
    # Checked before anything is measured: a late failure would lose the measurement.
    output = new_output(args.output, "--output", replace=args.force, create_folder=True)
    command = _script_command(args)
    if command is not None:
        return _main_script(args, command, output)
    if args.repeats is None:
        args.repeats = 3
    cfg = config_from_args(args)
    if cfg.train.output_dir:
        raise UsageError("bench keeps its runs in a temporary folder: drop --output-dir")
    plan = _plan(args, cfg)
    instance = resolve_instance_type(args.instance_type)
    check_mode_fits(plan.mode, instance[0])
    if not cfg.train.max_steps:
        steps = cfg.train.warmup_measure_steps + DEFAULT_MEASURED_STEPS
        cfg = replace(cfg, train=replace(cfg.train, max_steps=steps))
    measured = cfg.train.max_steps - cfg.train.warmup_measure_steps
    if measured < 1:
        raise UsageError(f"--max-steps {cfg.train.max_steps} leaves no step after the "
                         f"{cfg.train.warmup_measure_steps} warm-up steps (--warmup-measure-steps)")

    from neuron_train.training.device import resolve_precision

    cfg = resolve_precision(cfg)
    parameters, num_classes, train_samples = workload_facts(cfg)
    log = functools.partial(print, flush=True)
    log(f"bench: {plan.mode} {cfg.model.name} on {instance[0]} ({instance[1]}), "
        f"batch sizes {plan.batch_sizes}, processes {plan.nprocs}, {plan.repeats} repeat(s)")

    rows, runs, (nproc, bs) = measure_loop(plan, cfg, instance[0], num_classes, measured, args.sweep, log)
    cfg = replace(cfg, train=replace(cfg.train, batch_size=bs))
    line = shlex.join(["neuron-train", "bench", "--mode", plan.mode, "--nproc", str(nproc),
                       "--repeats", str(plan.repeats), *config_to_argv(cfg)])
    result = build_result(workload=loop_workload(cfg, parameters, num_classes, train_samples), mode=plan.mode,
                          instance=instance, runs=runs, sweep_rows=rows if args.sweep else None,
                          warmup=cfg.train.warmup_measure_steps, command=line)
    return _finish(result, output)


def _finish(result: BenchResult, output: Target) -> int:
    data = validate_result(result.to_json(), "bench")  # a file report would refuse is never written
    written = write_result(output, data)
    sps = result.samples_per_sec
    print(f"bench: {sps.median:.1f} samples/s (± {sps.spread:.1f}) on {result.device.kind} "
          f"x {result.world_size}, compile {result.compile.time_s:.1f} s in "
          f"{result.compile.graph_count} graph(s) (not counted) -> {written}", flush=True)
    if result.device.kind == "CPU":
        print("bench: measured on the CPU XLA device of this machine; the report labels it as such", flush=True)
    return 0
