"""inf1 measured in its own environment (scripts/inf1_bench.py) and inference on every NeuronCore
(cost/bench/percore.py): the contracts that can be checked without Neuron hardware.

What runs here is labelled: STAND-INs replace torch.neuron.trace / torch.neuron.DataParallel (the
inf1 script's schema-writing part runs for real on the CPU) and the per-core worker (our launch and
release protocol runs for real, with real processes). No Neuron figure is produced or claimed.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from neuron_train.cost.bench.failures import MeasureFailed
from neuron_train.cost.bench.percore import instance_figure, run_per_core
from neuron_train.cost.schema import validate_result
from tests.conftest import ROOT, cpu_env

SCRIPT = ROOT / "scripts" / "inf1_bench.py"
REFS = ROOT / "docs" / "example-report-inputs" / "references"


def load_script():
    spec = importlib.util.spec_from_file_location("inf1_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def no_imds() -> dict:
    return cpu_env(AWS_EC2_METADATA_DISABLED="true")


# --- scripts/inf1_bench.py ------------------------------------------------------------------------

@pytest.mark.slow
def test_inf1_script_outside_the_inf1_venv_refuses_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "inf1.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--output", str(out)], capture_output=True, text=True,
                          env=no_imds(), timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "inf1_bench: torch-neuron is not installed here: run this in the inf1 DLAMI's venv "
        "(source /opt/aws_neuron_venv_pytorch_1_13_inf1/bin/activate; docs/inf1.md)"]
    assert not out.exists()


def test_inf1_script_never_replaces_a_result(tmp_path):
    out = tmp_path / "inf1.json"
    out.write_text("{}")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--output", str(out)], capture_output=True, text=True,
                          env=no_imds(), timeout=120)
    assert proc.returncode == 1 and "exists: choose another --output or pass --force" in proc.stderr
    assert out.read_text() == "{}"


def test_inf1_timing_calls_the_model_from_its_threads_at_once_and_counts_every_sample():
    """As the published inf1 rows (Threads 4): the host threads call the data-parallel model together."""
    import threading

    bench = load_script()
    together = threading.Barrier(4, timeout=60)  # passes only when 4 calls are under way at once
    callers, lock = [], threading.Lock()

    class Batch:
        shape = (8, 3, 224, 224)

    def model(x):  # STAND-IN for the data-parallel module: waits for the other threads' calls
        with lock:
            callers.append(threading.get_ident())
        together.wait()

    sps, step_ms = bench.timed(model, Batch(), steps=3, warmup=0, threads=4)
    assert len(callers) == 12 and len(set(callers)) == 4  # 3 steps in each of 4 threads
    assert sps > 0 and step_ms > 0
    with pytest.raises(SystemExit):
        bench.parse_args(["--output", "x.json", "--threads", "0"])


def test_inf1_script_syntax_is_python_3_8():
    import ast

    ast.parse(SCRIPT.read_text(), feature_version=(3, 8))  # the inf1 venv may be older than ours


class StandInNeuron:
    """STAND-IN for torch.neuron (not torch-neuron): trace = torch.jit.trace on the CPU, DataParallel =
    the traced module itself. Records what the script asked of them."""

    def __init__(self):
        self.compiler_args, self.device_ids = None, None

    def trace(self, model, example_inputs, compiler_args):
        import torch

        self.compiler_args = compiler_args
        return torch.jit.trace(model, example_inputs[0])

    def data_parallel(self, module, device_ids):
        self.device_ids = device_ids
        return module


@pytest.fixture(scope="module")
def inf1_result(tmp_path_factory):
    """A result file written by the script's own code, figures from the STAND-IN (CPU) run."""
    bench, neuron = load_script(), StandInNeuron()
    out = tmp_path_factory.mktemp("inf1") / "inf1-standin.json"
    args = bench.parse_args(["--model", "resnet50", "--batch-size", "1", "--steps", "2", "--warmup", "1",
                             "--repeats", "2", "--output", str(out)])
    figures = bench.measure(args, neuron.trace, neuron.data_parallel, cores=4)
    result = bench.build_result(args, figures, 4, 4, ("inf1.xlarge", "flag"), "python scripts/inf1_bench.py ...")
    bench.write_new(out, result, force=False)
    return out, neuron


@pytest.mark.slow  # its fixture runs resnet50 on the CPU in this process: about a minute
def test_inf1_result_is_our_schema_and_asks_torch_neuron_for_every_core(inf1_result):
    out, neuron = inf1_result
    data = validate_result(json.loads(out.read_text()), str(out))  # the check `report` applies
    assert neuron.compiler_args == ["--fast-math", "all"] and neuron.device_ids == [0, 1, 2, 3]
    assert data["device"] == {"kind": "NEURON", "count": 4, "cores_total": 4, "tracer": "torch-neuron",
                              "compiler_args": "--fast-math all", "host_threads": 4,  # as the published row
                              "harness": "scripts/inf1_bench.py"}
    assert (data["batch_size_per_device"], data["global_batch_size"], data["world_size"]) == (1, 4, 4)
    assert data["model"]["parameters"] == 25_557_032  # torchvision resnet50, 1000 classes


@pytest.mark.slow
def test_report_shows_the_inf1_row_beside_inf2_and_labelled(inf1_result, tmp_path):
    out, _ = inf1_result
    proc = subprocess.run([sys.executable, "-m", "neuron_train", "report", str(out),
                           "--reference", str(REFS / "inf2_throughput_data_vision_cnn.csv"),
                           "--reference", str(REFS / "inf1_throughput_data_cnn.csv"),
                           "--reference-model", "resnet50", "--reference-model", "resnet-50",
                           "--out", str(tmp_path / "report")], capture_output=True, text=True, env=no_imds(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader((tmp_path / "report" / "report.csv").open()))
    measured = [r for r in rows if r["origin"] == "measured"]
    assert len(measured) == 1 and measured[0]["instance_type"] == "inf1.xlarge"
    row = measured[0]
    assert row["device"] == "NEURON, torch-neuron, 4 of 4 NeuronCores, 4 host thread(s)"
    assert row["precision"].startswith("fp32 (compiler --fast-math all: every fp32 op cast to bf16")
    assert row["provenance"].startswith("measured with scripts/inf1_bench.py: inf1-standin.json")
    same_group = {r["instance_type"] for r in rows if r["workload"] == row["workload"]}
    assert {"inf1.xlarge", "inf2.xlarge"} <= same_group


# --- bench --mode infer on inf1 in our environment -------------------------------------------------

@pytest.mark.slow
def test_bench_infer_on_inf1_refuses_in_one_line_naming_the_inf1_path(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "neuron_train", "bench", "--mode", "infer", "--instance-type",
                           "inf1.xlarge", "--output", str(tmp_path / "r.json")], capture_output=True, text=True,
                          env=no_imds(), timeout=120)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert ("inf1.xlarge" in line and "scripts/inf1_bench.py" in line
            and "/opt/aws_neuron_venv_pytorch_1_13_inf1" in line)
    assert not (tmp_path / "r.json").exists()


# --- every NeuronCore at once: the launch and release protocol, with a STAND-IN worker ---------------

STANDIN_WORKER = textwrap.dedent("""
    # STAND-IN for neuron_train.cost.bench.core_worker (no model, no Neuron runtime): follows its protocol.
    import json, os, sys, time
    core = int(os.environ["NEURON_RT_VISIBLE_CORES"])
    log = os.path.join(sys.argv[1], f"core{core}")
    open(log + ".pid", "w").write(str(os.getpid()))
    noisy = len(sys.argv) > 3  # the runtime's log lines on stderr, also after the result
    if core == int(sys.argv[2]):
        print("Failed to allocate 1.0GB on NeuronCore", file=sys.stderr, flush=True)  # the runtime's stream
        sys.exit(1)
    if noisy:
        print("2026-Nov-27 WARN NRT:nrt_init  loading\\n" * 5000, file=sys.stderr, flush=True)  # more than a pipe holds
    time.sleep(0.05 * core)  # cores get ready at different times
    open(log + ".ready", "w").write(repr(time.time()))
    print("READY", flush=True)
    sys.stdin.readline()
    open(log + ".go", "w").write(repr(time.time()))
    print(json.dumps({"samples_per_sec": 100.0 + core, "step_time_ms": 10.0 + core}), flush=True)
    if noisy:
        print("nrt_close: released NeuronCore", flush=True)  # a line after the result, on stdout
        print('2026-Nov-27 WARN NRT:nrt_close {"core": 0}', file=sys.stderr, flush=True)
""")


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "standin_worker.py"
    path.write_text(STANDIN_WORKER)
    return lambda failing=-1, noisy=False: [sys.executable, str(path), str(tmp_path), str(failing),
                                            *(["noisy"] if noisy else [])]


def test_per_core_workers_run_one_per_core_and_start_timing_together(worker, tmp_path):
    figures = run_per_core(worker(), [0, 1, 2, 3])
    assert [f.core for f in figures] == [0, 1, 2, 3]
    assert instance_figure(figures) == (406.0, 13.0)  # throughputs add up; the slowest core's step
    ready = [float((tmp_path / f"core{c}.ready").read_text()) for c in range(4)]
    go = [float((tmp_path / f"core{c}.go").read_text()) for c in range(4)]
    assert max(ready) <= min(go)  # no core was timed while another was still loading


def test_a_workers_stderr_and_lines_after_its_result_do_not_hide_the_result(worker):
    """The runtime logs to stderr, also after the result line: stderr is kept apart, and the result is
    the last stdout line that parses as one."""
    figures = run_per_core(worker(noisy=True), [0, 1])
    assert [(f.core, f.samples_per_sec, f.step_time_ms) for f in figures] == [(0, 100.0, 10.0), (1, 101.0, 11.0)]


def test_a_failing_core_fails_the_measurement_with_its_reason_and_no_worker_is_left(worker, tmp_path):
    start = time.monotonic()
    with pytest.raises(MeasureFailed) as failed:
        run_per_core(worker(failing=2), [0, 1, 2, 3])
    assert failed.value.status == "oom" and failed.value.reason.startswith("NeuronCore 2: Failed to allocate")
    assert not (tmp_path / "core0.go").exists()  # nobody was released: nothing half-measured
    assert time.monotonic() - start < 60
    for pid_file in tmp_path.glob("core*.pid"):  # every worker ended (killed and reaped), none keeps a core
        cmdline = Path(f"/proc/{pid_file.read_text()}/cmdline")
        assert not cmdline.exists() or b"standin_worker" not in cmdline.read_bytes()  # (a reused pid is not ours)


@pytest.mark.parametrize("loaded, refused", [("2.24.13.0", None), ("2.27.4.0", "Neuron driver 2.27.4.0 is loaded"),
                                             (None, "cannot read the Neuron driver's version")])
def test_inf1_script_runs_only_on_a_2_24_driver(tmp_path, loaded, refused):
    """Neuron's 2026-03 correction: drivers above 2.24 support no Inf1; inf1 pins aws-neuronx-dkms 2.24.*.
    The script's own check, on a version file written here (the real one: /sys/module/neuron/version)."""
    bench = load_script()
    version_file = tmp_path / "version"
    if loaded:
        version_file.write_text(loaded + "\n")
    if refused is None:
        assert bench.check_driver(version_file) == loaded
        return
    with pytest.raises(bench.Refused) as stop:
        bench.check_driver(version_file)
    assert refused in str(stop.value) and "aws-neuronx-dkms=2.24.*" in str(stop.value)
