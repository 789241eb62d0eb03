"""`neuron-train bench`: measure this machine on one model and write one result file.

`train` mode runs our training loop (`neuron_train/run.py`, under torchrun for several processes)
and reads its summary.json; `infer` mode times a compiled forward pass (the CPU XLA device, or
`torch_neuronx.trace` / `torch_neuron` tracing on Neuron hardware). Warm-up steps and compile time
are kept out of the throughput figures and reported apart. The result file format is versioned and
documented in docs/bench.md; `validate_result` is the one check of it that `report` also uses.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import socket
import tempfile
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.fileio import new_output, write_json_or_print
from neuron_train.common.neuron_env import library_versions
from neuron_train.cost import script_bench
from neuron_train.cost.failures import MeasureFailed
from neuron_train.cost.measure import InferBench, Measurement, Workload, measure_train
from neuron_train.cost.schema import MODES, SCHEMA_NAME, SCHEMA_VERSION, validate_result
from neuron_train.instrument.script import checked_command
from neuron_train.training.config import RunConfig
from neuron_train.training.config_io import add_config_arguments, config_from_args, config_to_argv
from neuron_train.training.metrics import median_and_spread

DEFAULT_MEASURED_STEPS = 20          # when --max-steps is not given
DEFAULT_SWEEP_BATCH_SIZES = (8, 16, 32, 64, 128, 256)
IMDS_ENDPOINT = "http://169.254.169.254"
_VERSIONED = ("neuron-train", "torch", "torch-xla", "torchvision", "timm", "torch-neuronx",
              "neuronx-cc", "libneuronxla", "torch-neuron")

# --- where we are: instance type, host, versions ------------------------------------------------

def detect_instance_type(timeout: float = 1.0) -> str | None:
    """The EC2 instance type from the instance metadata service (IMDSv2), or None off EC2.

    Honours the AWS SDKs' variables: AWS_EC2_METADATA_DISABLED=true skips the lookup,
    AWS_EC2_METADATA_SERVICE_ENDPOINT points it elsewhere (tests use a local stub).
    """
    if os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
        return None
    base = os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", IMDS_ENDPOINT).rstrip("/")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    try:
        token_req = urllib.request.Request(f"{base}/latest/api/token", method="PUT",
                                           headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        token = opener.open(token_req, timeout=timeout).read().decode()
        type_req = urllib.request.Request(f"{base}/latest/meta-data/instance-type",
                                          headers={"X-aws-ec2-metadata-token": token})
        itype = opener.open(type_req, timeout=timeout).read().decode().strip()
    except (OSError, ValueError):  # URLError, timeouts, refused connections: not on EC2
        return None
    return itype or None


def resolve_instance_type(flag: str | None) -> tuple[str, str]:
    """(instance type, how it was found): the metadata service wins; a contradicting flag is an error."""
    detected = detect_instance_type()
    if detected and flag and flag != detected:
        raise UsageError(f"--instance-type {flag} contradicts this machine, which the EC2 metadata "
                         f"service reports as {detected}")
    if detected:
        return detected, "ec2-metadata"
    return (flag, "flag") if flag else ("local", "default")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_metadata() -> dict:
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem = None
    try:
        load = round(os.getloadavg()[0], 2)  # a busy host spreads the repeats: say how busy it was
    except OSError:
        load = None
    return {"hostname": socket.gethostname(), "os": platform.platform(), "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(), "memory_gib": round(mem, 1) if mem else None,
            "load_average_1m": load, "python": platform.python_version()}


# --- sweep and repeats ---------------------------------------------------------------------------

def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return sorted(set(values))


@dataclass
class Plan:
    mode: str
    batch_sizes: list[int]
    nprocs: list[int]
    repeats: int


def sweep(plan: Plan, measure, log) -> tuple[list[dict], dict[tuple[int, int], Measurement]]:
    """Measure every (processes, batch size) once; after an OOM, larger batches are not tried.

    Returns the sweep rows (ok / oom / failed, with the reason) and the successful measurements.
    """
    rows: list[dict] = []
    ok: dict[tuple[int, int], Measurement] = {}
    for nproc in plan.nprocs:
        for bs in plan.batch_sizes:
            try:
                m = measure(bs, nproc)
            except MeasureFailed as exc:
                rows.append({"batch_size_per_device": bs, "world_size": nproc, "status": exc.status,
                             "reason": exc.reason})
                log(f"  batch {bs} x {nproc} process(es): {exc.status}: {exc.reason}")
                if exc.status == "oom":
                    rows[-1]["reason"] += " (larger batch sizes not tried)"
                    break
                continue
            ok[(nproc, bs)] = m
            rows.append({"batch_size_per_device": bs, "world_size": m.world_size, "status": "ok",
                         "reason": "", "samples_per_sec": m.samples_per_sec,
                         "step_time_ms": m.step_time_ms, "compile_time_s": m.compile_time_s,
                         "graph_count": m.graph_count})
            log(f"  batch {bs} x {nproc} process(es): {m.samples_per_sec:.1f} samples/s")
    return rows, ok


def _stat(values: list[float]) -> dict:
    median, spread = median_and_spread(values)
    return {"median": median, "spread": spread, "values": values}


def build_result(*, workload: Workload, mode: str, instance: tuple[str, str], runs: list[Measurement],
                 sweep_rows: list[dict] | None, warmup: int, command: str) -> dict:
    first = runs[0]
    compiled = [r for r in runs if r.graph_count > 0] or runs
    return {
        "schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode, "instance_type": instance[0], "instance_type_source": instance[1],
        "device": {"kind": first.device_kind, "count": first.world_size, **first.device_info},
        "world_size": first.world_size,
        "model": {"name": workload.model, "parameters": workload.parameters, "img_size": workload.img_size,
                  "num_classes": workload.num_classes},
        "dataset": {"name": workload.dataset, "train_samples": workload.train_samples},
        "batch_size_per_device": workload.batch_size, "global_batch_size": first.global_batch_size,
        "precision": workload.precision, "warmup_steps": warmup,
        "measured_steps": first.measured_steps, "repeats": len(runs),
        "samples_per_sec": _stat([r.samples_per_sec for r in runs]),
        "step_time_ms": _stat([r.step_time_ms for r in runs]),
        "compile": {"time_s": median_and_spread([r.compile_time_s for r in compiled])[0],
                    "graph_count": max(r.graph_count for r in compiled)},
        "details": first.details,
        "sweep": sweep_rows, "host": host_metadata(), "versions": library_versions(_VERSIONED),
        "command": command, "config": workload.config,
    }


def loop_workload(cfg: RunConfig, parameters: int, num_classes: int, train_samples: int) -> Workload:
    return Workload(cfg.model.name, parameters, cfg.model.img_size, num_classes, cfg.data.dataset, train_samples,
                    cfg.train.batch_size, cfg.train.precision, cfg.to_dict())


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


def _plan(args: argparse.Namespace, cfg: RunConfig) -> Plan:
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
    return Plan(args.mode, batch_sizes, nprocs, args.repeats)


def _check_mode_fits(mode: str, instance_type: str) -> None:
    from neuron_train.cost.catalog import load_catalog
    from neuron_train.cost.measure import refuse_inf1_inference

    spec = load_catalog().get(instance_type)
    if mode == "train" and spec is not None and not spec.can_train:
        raise UsageError(f"{instance_type} cannot train: {spec.train_note}; use --mode infer")
    if mode == "infer":
        refuse_inf1_inference(instance_type)


def _workload_facts(cfg: RunConfig) -> tuple[int, int, int]:
    """(parameters, classes, training samples) of the configured model and dataset."""
    from neuron_train.training.data import build_datasets
    from neuron_train.training.models import build_model, count_parameters

    data = build_datasets(cfg.data, cfg.model.img_size, cfg.model.num_classes, cfg.train.seed)
    model = build_model(cfg.model.name, num_classes=data.num_classes, img_size=cfg.model.img_size)
    return count_parameters(model), data.num_classes, len(data.train)


def _write_result(output: Path, result: dict) -> None:
    write_json_or_print(output, result, "save it as a .json file for `neuron-train report`")


def _measure(plan: Plan, cfg: RunConfig, instance_type: str, num_classes: int, measured: int, sweeping: bool,
             log) -> tuple[list[dict], list[Measurement], tuple[int, int]]:
    """The sweep (or the one configuration), then the repeats of the fastest: (sweep rows, runs,
    (processes, batch size) measured)."""
    with tempfile.TemporaryDirectory(prefix="neuron-train-bench-") as tmp:
        if plan.mode == "train":
            def measure(bs: int, nproc: int) -> Measurement:
                return measure_train(replace(cfg, train=replace(cfg.train, batch_size=bs)), nproc, Path(tmp))
        else:
            bench = InferBench(cfg, num_classes, instance_type, Path(tmp))

            def measure(bs: int, nproc: int) -> Measurement:
                return bench.measure(bs, measured, cfg.train.warmup_measure_steps)

        rows, ok = sweep(plan, measure, log)
        if not ok:
            reasons = "; ".join(f"batch {r['batch_size_per_device']}: {r['reason']}" for r in rows)
            raise RunError(f"no configuration could be measured ({reasons})")
        (nproc, bs), best = max(ok.items(), key=lambda kv: kv[1].samples_per_sec)
        if sweeping:
            log(f"bench: fastest is batch {bs} x {nproc} process(es); measuring it "
                f"{plan.repeats - 1} more time(s)")
        runs = [best]
        for i in range(plan.repeats - 1):
            try:
                runs.append(measure(bs, nproc))
            except MeasureFailed as exc:
                raise RunError(f"repeat {i + 2} of batch {bs} x {nproc} failed: {exc.reason}") from None
            log(f"  repeat {i + 2}: {runs[-1].samples_per_sec:.1f} samples/s")
    return rows, runs, (nproc, bs)


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


def _main_script(args: argparse.Namespace, command: list[str], output: Path) -> int:
    repeats = args.repeats or 1
    if repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {repeats}")
    instance = resolve_instance_type(args.instance_type)
    mode = args.mode or "train"
    _check_mode_fits(mode, instance[0])
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
    _check_mode_fits(plan.mode, instance[0])
    if not cfg.train.max_steps:
        steps = cfg.train.warmup_measure_steps + DEFAULT_MEASURED_STEPS
        cfg = replace(cfg, train=replace(cfg.train, max_steps=steps))
    measured = cfg.train.max_steps - cfg.train.warmup_measure_steps
    if measured < 1:
        raise UsageError(f"--max-steps {cfg.train.max_steps} leaves no step after the "
                         f"{cfg.train.warmup_measure_steps} warm-up steps (--warmup-measure-steps)")

    from neuron_train.training.device import resolve_precision

    cfg = resolve_precision(cfg)
    parameters, num_classes, train_samples = _workload_facts(cfg)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    log(f"bench: {plan.mode} {cfg.model.name} on {instance[0]} ({instance[1]}), "
        f"batch sizes {plan.batch_sizes}, processes {plan.nprocs}, {plan.repeats} repeat(s)")

    rows, runs, (nproc, bs) = _measure(plan, cfg, instance[0], num_classes, measured, args.sweep, log)
    cfg = replace(cfg, train=replace(cfg.train, batch_size=bs))
    line = shlex.join(["neuron-train", "bench", "--mode", plan.mode, "--nproc", str(nproc),
                       "--repeats", str(plan.repeats), *config_to_argv(cfg)])
    result = build_result(workload=loop_workload(cfg, parameters, num_classes, train_samples), mode=plan.mode,
                          instance=instance, runs=runs, sweep_rows=rows if args.sweep else None,
                          warmup=cfg.train.warmup_measure_steps, command=line)
    return _finish(result, output)


def _finish(result: dict, output: Path) -> int:
    validate_result(result, "bench")  # a file report would refuse is never written
    _write_result(output, result)
    sps = result["samples_per_sec"]
    print(f"bench: {sps['median']:.1f} samples/s (± {sps['spread']:.1f}) on {result['device']['kind']} "
          f"x {result['world_size']}, compile {result['compile']['time_s']:.1f} s in "
          f"{result['compile']['graph_count']} graph(s) (not counted) -> {output}", flush=True)
    if result["device"]["kind"] == "CPU":
        print("bench: measured on the CPU XLA device of this machine; the report labels it as such", flush=True)
    return 0
