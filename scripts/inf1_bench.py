#!/usr/bin/env python3
"""Inference throughput of an inf1 instance, measured in inf1's own environment, written as a
`neuron-train bench` result file (schema neuron-train-bench-result, version 1) for `neuron-train report`.

inf1 (NeuronCore-v1) runs only torch-neuron, built for torch 1.13, and only on Neuron drivers that
our pinned SDK (2.29.1) no longer ships; so this script imports nothing of neuron_train and needs
only what the inf1 DLAMI's venv has: torch 1.13, torchvision and torch-neuron. Python 3.8+ syntax.
Step by step: docs/inf1.md.

    source /opt/aws_neuron_venv_pytorch_1_13_inf1/bin/activate
    python inf1_bench.py --model resnet50 --batch-size 1 --output inf1-infer.json

The model (a torchvision model, random weights: nothing is downloaded) is compiled once with
torch.neuron.trace, then replicated on every NeuronCore of the instance with torch.neuron.DataParallel
(one copy per core, the batch split across them), as the published inf1 figures are made. Each step
takes a host batch of batch-size x cores images and returns the logits to the host; warm-up steps
(the first loads the copies onto the cores) are left out; compile time is reported apart. Like the
published rows (their "Threads" column: 4 for ResNet-50 on inf1.xlarge), several host threads call
the model at once (--threads, default 4), so one thread's Python time between steps does not leave
the cores idle; the result records the count (device.host_threads) and the report's row says it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

SCHEMA_NAME, SCHEMA_VERSION = "neuron-train-bench-result", 1   # docs/bench.md, "Result file format"
HARNESS = "scripts/inf1_bench.py"
INF1_VENV = "/opt/aws_neuron_venv_pytorch_1_13_inf1"
CORES_PER_INFERENTIA = 4   # NeuronCore-v1: 4 per Inferentia chip, one chip per /dev/neuronN
VERSIONED = ("torch", "torchvision", "torch-neuron", "neuron-cc")
IMDS = "http://169.254.169.254"
# "Correction: Neuron Driver support for Inf1 - version 2.24 (not 2.21)" (Neuron announcement, 2026-03):
# drivers above 2.24 support no Inf1; Inf1 users pin aws-neuronx-dkms to 2.24.*.
INF1_DRIVER = "2.24."
DRIVER_VERSION_FILE = "/sys/module/neuron/version"   # the loaded driver's version


class Refused(Exception):
    """A one-line reason this run cannot go on, with the fix."""


def parse_args(argv: list) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50", help="torchvision model name (default: resnet50)")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=1, help="images per NeuronCore per step (default: 1)")
    p.add_argument("--cores", type=int, default=0, help="NeuronCores to use (default 0: every core of the instance)")
    p.add_argument("--fast-math", default="all", choices=("all", "none"),
                   help="neuron-cc --fast-math: all (its default: fp32 ops cast to bf16, as the published inf1 "
                        "figures) or none (most precise: matmuls still cast to a 16-bit type)")
    p.add_argument("--threads", type=int, default=4,
                   help="host threads calling the model at once (default 4: the published inf1 ResNet-50 "
                        "row's Threads); recorded in the result and shown on the report's row")
    p.add_argument("--steps", type=int, default=100, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=10, help="steps left out before timing")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--instance-type", help="when the EC2 metadata service is unreachable (default: detected)")
    p.add_argument("--output", required=True, help="result file to write (refused if it exists, unless --force)")
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    for name in ("img_size", "num_classes", "batch_size", "steps", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error("--{} must be >= 1".format(name.replace("_", "-")))
    if args.warmup < 0 or args.cores < 0:
        p.error("--warmup and --cores must be >= 0")
    return args


# --- where we are ---------------------------------------------------------------------------------

def instance_type(flag: str | None) -> tuple:
    """(instance type, source): the EC2 metadata service (IMDSv2), else the flag, else 'local'."""
    if os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true":
        base = os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", IMDS).rstrip("/")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            token = opener.open(urllib.request.Request(
                base + "/latest/api/token", method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}), timeout=1).read().decode()
            found = opener.open(urllib.request.Request(
                base + "/latest/meta-data/instance-type",
                headers={"X-aws-ec2-metadata-token": token}), timeout=1).read().decode().strip()
        except (OSError, ValueError):
            found = ""
        if found:
            if flag and flag != found:
                raise Refused(f"--instance-type {flag} contradicts this machine ({found})")
            return found, "ec2-metadata"
    return (flag, "flag") if flag else ("local", "default")


def host_metadata() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return {"hostname": socket.gethostname(), "os": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "load_average_1m": load, "python": platform.python_version()}


def versions() -> dict:
    from importlib import metadata  # Python 3.8+

    found = {}
    try:
        found["aws-neuronx-dkms (loaded)"] = Path(DRIVER_VERSION_FILE).read_text().strip()
    except OSError:
        pass
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def neuron_api():
    """(trace, DataParallel, NeuronCores present) of torch-neuron, or Refused naming the fix."""
    try:
        import torch
        import torch_neuron  # noqa: F401  registers torch.neuron
    except ImportError:
        raise Refused("torch-neuron is not installed here: run this in the inf1 DLAMI's venv "
                      f"(source {INF1_VENV}/bin/activate; docs/inf1.md)") from None
    chips = len(list(Path("/dev").glob("neuron[0-9]*")))
    if not chips:
        raise Refused("no Neuron device (/dev/neuron*): run this on an inf1 instance (docs/inf1.md)")
    check_driver(Path(DRIVER_VERSION_FILE))
    return torch.neuron.trace, torch.neuron.DataParallel, chips * CORES_PER_INFERENTIA


def check_driver(version_file: Path) -> str:
    """The loaded Neuron driver's version, if it is one that supports inf1 (2.24.*); else Refused."""
    pin = (f"sudo apt-get install -y --allow-downgrades aws-neuronx-dkms={INF1_DRIVER}* "
           "&& sudo apt-mark hold aws-neuronx-dkms")
    try:
        loaded = version_file.read_text().strip()
    except OSError:
        raise Refused(f"cannot read the Neuron driver's version ({version_file}): is the driver loaded? "
                      f"inf1 needs aws-neuronx-dkms {INF1_DRIVER}*: {pin}") from None
    if not loaded.startswith(INF1_DRIVER):
        raise Refused(f"Neuron driver {loaded} is loaded; drivers after {INF1_DRIVER}* support no inf1 "
                      f"(Neuron's 2026-03 notice): {pin}, then reboot (docs/inf1.md)")
    return loaded


# --- the measurement --------------------------------------------------------------------------------

def median_and_spread(values: list) -> tuple:
    """Median and half the 10th-90th percentile range (half the range below 3 values), as bench does."""
    if len(values) < 3:
        return statistics.median(values), (max(values) - min(values)) / 2
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), (deciles[-1] - deciles[0]) / 2


def timed(model, x, steps: int, warmup: int, threads: int = 1) -> tuple:
    """(samples/s, median step ms) of `threads` host threads making `steps` calls each at once, after
    `warmup` calls; a thread's error is raised here, after every thread has ended."""
    for _ in range(warmup):
        model(x)
    times, errors = [], []  # list.append is atomic: the threads share them

    def calls() -> None:
        try:
            for _ in range(steps):
                t = time.perf_counter()
                model(x)  # host batch in, logits back on the host
                times.append(time.perf_counter() - t)
        except Exception as exc:  # re-raised below, in the calling thread
            errors.append(exc)

    pool = [threading.Thread(target=calls) for _ in range(threads)]
    start = time.perf_counter()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    total = time.perf_counter() - start
    if errors:
        raise errors[0]
    return x.shape[0] * steps * threads / total, statistics.median(times) * 1e3


def measure(args: argparse.Namespace, trace, data_parallel, cores: int) -> dict:
    """Compile, replicate on `cores` NeuronCores, time `repeats` times: the figures of the result."""
    import torch
    import torchvision

    model = getattr(torchvision.models, args.model)(num_classes=args.num_classes).eval()
    example = torch.rand(args.batch_size, 3, args.img_size, args.img_size)
    start = time.perf_counter()
    compiled = trace(model, example_inputs=[example], compiler_args=["--fast-math", args.fast_math])
    compile_s = time.perf_counter() - start
    parallel = data_parallel(compiled, device_ids=list(range(cores)))  # one copy per NeuronCore
    x = torch.rand(args.batch_size * cores, 3, args.img_size, args.img_size)
    runs = []
    with torch.no_grad():
        for i in range(args.repeats):
            runs.append(timed(parallel, x, args.steps, args.warmup if i == 0 else 1, args.threads))
            print(f"inf1_bench: repeat {i + 1}: {runs[-1][0]:.1f} samples/s", flush=True)
    return {"compile_s": compile_s, "sps": [r[0] for r in runs], "step_ms": [r[1] for r in runs],
            "parameters": sum(p.numel() for p in model.parameters())}


def build_result(args: argparse.Namespace, figures: dict, cores: int, cores_total: int, instance: tuple,
                 command: str) -> dict:
    def stat(values: list) -> dict:
        median, spread = median_and_spread(values)
        return {"median": median, "spread": spread, "values": values}

    return {
        "schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": "infer", "instance_type": instance[0], "instance_type_source": instance[1],
        "device": {"kind": "NEURON", "count": cores, "cores_total": cores_total, "tracer": "torch-neuron",
                   "compiler_args": "--fast-math " + args.fast_math, "host_threads": args.threads,
                   "harness": HARNESS},
        "world_size": cores,
        "model": {"name": args.model, "parameters": figures["parameters"], "img_size": args.img_size,
                  "num_classes": args.num_classes},
        "dataset": {"name": "synthetic", "train_samples": None},
        "batch_size_per_device": args.batch_size, "global_batch_size": args.batch_size * cores,
        "precision": "fp32", "warmup_steps": args.warmup, "measured_steps": args.steps, "repeats": args.repeats,
        "samples_per_sec": stat(figures["sps"]), "step_time_ms": stat(figures["step_ms"]),
        "compile": {"time_s": figures["compile_s"], "graph_count": 1},
        "details": {}, "sweep": None, "host": host_metadata(), "versions": versions(),
        "command": command, "config": {k: v for k, v in vars(args).items() if k not in ("output", "force")},
    }


def write_new(path: Path, result: dict, force: bool) -> None:
    """Write the whole file or nothing (temporary file, then rename); never replace one unless --force."""
    if path.exists() and not force:
        raise Refused(f"{path} exists: choose another --output or pass --force")
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(str(tmp), str(path))


def main(argv: list) -> int:
    args = parse_args(argv)
    output = Path(args.output)
    try:
        if output.exists() and not args.force:  # before anything is measured
            raise Refused(f"{output} exists: choose another --output or pass --force")
        if not output.parent.is_dir():
            raise Refused(f"--output: no such folder: {output.parent}")
        instance = instance_type(args.instance_type)
        trace, data_parallel, cores_total = neuron_api()
        if args.cores > cores_total:
            raise Refused(f"--cores {args.cores}: this instance has {cores_total} NeuronCores")
        cores = args.cores or cores_total
        figures = measure(args, trace, data_parallel, cores)
        command = " ".join(["python", HARNESS] + argv)
        write_new(output, build_result(args, figures, cores, cores_total, instance, command), args.force)
    except Refused as exc:
        print(f"inf1_bench: {exc}", file=sys.stderr)
        return 1
    print("inf1_bench: {:.1f} samples/s on {} of {} NeuronCores -> {}".format(
        median_and_spread(figures["sps"])[0], cores, cores_total, output), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
