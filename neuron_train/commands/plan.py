"""`neuron-train plan`: estimate throughput and cost on every trn1/inf2 (and inf1 for inference)
instance type from one CPU run, before renting any; `--calibrate bench.json` re-fits the device
side from one real bench. Everything it prints is an estimate (docs/plan.md).

The command parses and checks its options and runs the steps, which are library code in cost/plan/:
`measure` (the step traced or counted), `model` (the estimates), `calibrate`, `result` (the one
printer of the estimates, and plan.json).
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex

from neuron_train.common.errors import UsageError
from neuron_train.common.fileio import new_output, write_json_or_print
from neuron_train.cost.plan import calibrate as plan_calibrate
from neuron_train.cost.plan import data as plan_data
from neuron_train.cost.plan.model import EXECUTIONS, UNKNOWN, WorkloadFigures, estimate_all
from neuron_train.cost.plan.result import format_estimates, plan_document
from neuron_train.cost.schema import MODES
from neuron_train.instrument.script import checked_command
from neuron_train.training.config import RunConfig
from neuron_train.training.config_io import add_config_arguments, config_from_args, config_to_argv

_USAGE = ("neuron-train plan [options] -- COMMAND [ARGS...]  or  "
          "neuron-train plan [options] --model NAME [TRAIN OPTIONS]")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.usage = _USAGE
    parser.description = ("Estimate samples/s, $ per 1M samples and per epoch, the bottleneck and the "
                          "price-performance ranking of every trn1/inf2 instance type (inf1 too with --mode infer) "
                          "from one run on this machine's CPU XLA device. Estimates, calibrated on published "
                          "Neuron rows; --calibrate re-fits them on one real bench result.")
    g = parser.add_argument_group("plan options")
    g.add_argument("--mode", choices=MODES, default="train", help="training step or forward pass (default: train)")
    g.add_argument("--instances", metavar="T1,T2,..", help="instance types to estimate (default: every trn1/inf2 "
                   "type of the catalog; inf1 too with --mode infer)")
    g.add_argument("--nproc-per-instance", default="auto", metavar="N|auto",
                   help="data-parallel processes per instance (default auto: one per NeuronCore)")
    g.add_argument("--epoch-samples", type=int, metavar="N", help="samples in one epoch, for $ per epoch "
                   "(default: our loop's dataset size; unknown for a COMMAND)")
    g.add_argument("--calibrate", metavar="BENCH.json", help="a bench result of this workload on one Neuron "
                   "instance type: re-fit the device side on it and re-predict the others")
    g.add_argument("--execution", choices=sorted(EXECUTIONS), help="how the target runs a step, which decides "
                   "the host term: " + "; ".join(f"{k}: {v}" for k, v in EXECUTIONS.items()) + " (default: compiled "
                   "for --mode infer, as the published rows; for training lazy, or replay when our loop's "
                   "--step-compiler is a dynamo one)")
    g.add_argument("--from-shapes", action="store_true", help="count the model on the meta device instead of "
                   "running it (automatic when it would not fit in this machine's memory)")
    g.add_argument("--output", metavar="PLAN.json", help="write the estimates (bench result schema, source: "
                   "estimated) for 'neuron-train report'")
    g.add_argument("--force", action="store_true", help="replace an existing --output file")
    c = parser.add_argument_group("a COMMAND's options (as for bench -- COMMAND)")
    c.add_argument("--samples-per-step", type=int, metavar="N", help="samples one process's step trains on")
    c.add_argument("--steps", type=int, default=3, metavar="N", help="steady steps to run before the command "
                   "is stopped (default 3: the step's graph is read from XLA's dump; nothing is timed)")
    c.add_argument("--workload", metavar="NAME", help="the workload's name (default: the script's file name)")
    ours = len(parser._action_groups)
    add_config_arguments(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: a PyTorch/XLA command")
    _plan_options_first(parser, ours)


def _plan_options_first(parser: argparse.ArgumentParser, ours: int) -> None:
    """--help lists plan's own options first, then a COMMAND's, then our loop's TRAIN OPTIONS, each of
    their groups titled as such (argparse prints groups in the order of this list)."""
    groups = parser._action_groups
    positional, general, plan_groups, train_groups = groups[0], groups[1], groups[2:ours], groups[ours:]
    general.title = "general"
    for g in train_groups:
        g.title = f"TRAIN OPTIONS (our loop only): {g.title}"
    parser._action_groups = [*plan_groups, general, *train_groups, positional]


def _processes(value: str) -> int | None:
    """--nproc-per-instance: a number of processes (at most an instance's NeuronCores), None for auto."""
    if value == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        raise UsageError(f"--nproc-per-instance must be a number or auto, got {value!r}") from None
    if n < 1:
        raise UsageError(f"--nproc-per-instance must be >= 1, got {n}")
    return n


def _workload_source(args: argparse.Namespace) -> tuple[list[str] | None, RunConfig | None]:
    """(COMMAND, None) or (None, our loop's RunConfig); refused when neither or both are given."""
    train_flags = getattr(args, "config", None) or any("." in key for key in vars(args))
    if args.command:
        command = checked_command(args.command, _USAGE)
        if train_flags:
            raise UsageError("train options (--model, --batch-size, ...) describe neuron-train's own loop: a "
                             "COMMAND is measured as it runs; drop them")
        return command, None
    if not train_flags:
        raise UsageError(f"nothing to plan: give a training command after -- or our loop's options ({_USAGE})")
    return None, config_from_args(args)


def _check_flags(args: argparse.Namespace) -> None:
    for flag, value, low in (("--samples-per-step", args.samples_per_step, 1), ("--steps", args.steps, 1),
                             ("--epoch-samples", args.epoch_samples, 1)):
        if value is not None and value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")


def _not_the_calibration(args: argparse.Namespace) -> None:
    """--output naming the --calibrate input (even through another name or a link) would replace the
    bench result the plan is calibrated on: refused, with or without --force."""
    if args.output and args.calibrate and os.path.realpath(args.output) == os.path.realpath(args.calibrate):
        raise UsageError(f"--output {args.output} is the --calibrate input: write the plan to another file "
                         "(the bench result is kept)")


def main(args: argparse.Namespace) -> int:
    # Everything that can be refused is refused before the run: a late failure would lose it.
    _not_the_calibration(args)
    output = new_output(args.output, "--output", replace=args.force, create_folder=True) if args.output else None
    _check_flags(args)
    command, cfg = _workload_source(args)
    known = plan_data.targets()
    wanted = plan_data.wanted_instances(args.instances)
    chosen = plan_data.choose_targets(known, wanted, args.mode)
    processes = _processes(args.nproc_per_instance)
    if (capped := plan_data.capped_note(processes, chosen)) is not None:
        print(capped, flush=True)
    if command:
        name = args.workload or _script_name(command)
    else:
        assert cfg is not None  # no COMMAND: _workload_source returned our loop's config
        name = cfg.model.name
    bench = plan_calibrate.load_calibration(args.calibrate, args.mode, name, known) if args.calibrate else None
    if command:
        from neuron_train.cost.plan.measure import image_size, measure_script

        print(f"plan: running {shlex.join(command)} under the probe with XLA's HLO dump", flush=True)
        w, details = measure_script(command, steps=args.steps, samples_flag=args.samples_per_step, mode=args.mode,
                                    name=args.workload, execution=args.execution)
        img, dataset, precision = image_size(details.get("batch_shape")), UNKNOWN, UNKNOWN
        if bench is not None:  # the step's batch is known once it ran
            plan_calibrate.check_workload(bench, args.calibrate, w.samples_per_step, img, None)
        epoch_samples = args.epoch_samples
        line = ["--steps", str(args.steps), "--", *command]
    else:
        assert cfg is not None  # no COMMAND: _workload_source returned our loop's config
        from neuron_train.training.device import resolve_precision  # imports torch: only here

        cfg = resolve_precision(cfg)
        if bench is not None:  # refused before the step is traced
            plan_calibrate.check_workload(bench, args.calibrate, cfg.train.batch_size, cfg.model.img_size,
                                          cfg.train.precision)
        w, details = _measure_loop(args, cfg)
        img, dataset, precision = cfg.model.img_size, cfg.data.dataset, cfg.train.precision
        epoch_samples = args.epoch_samples or details.get("train_samples")
        line = config_to_argv(cfg)
    calib, first_off, told = plan_calibrate.calibration(w, bench, known, args.calibrate, processes)
    for text in told:
        print(text, flush=True)
    ests = estimate_all(w, chosen, calib, processes, epoch_samples)
    print("\n".join(format_estimates(w, ests, calib)))
    if output is not None:
        document = plan_document(w, ests, calib, details=details, first_off=first_off, img_size=img, dataset=dataset,
                                 epoch_samples=epoch_samples, precision=precision,
                                 command=shlex.join(["neuron-train", "plan", "--mode", args.mode, *line]))
        written = write_json_or_print(output, document, "save it as a .json file for `neuron-train report`")
        print(f"plan: {len(document['results'])} estimate(s) -> {written} (source: estimated)")
    return 0


def _measure_loop(args: argparse.Namespace, cfg: RunConfig) -> tuple[WorkloadFigures, dict]:
    from neuron_train.cost.plan import measure as plan_measure

    return plan_measure.measure_or_count(cfg, args.mode, args.execution, args.from_shapes,
                                         functools.partial(print, flush=True))


def _script_name(command: list[str]) -> str:
    from neuron_train.cost.script_figures import script_name

    return script_name(command)
