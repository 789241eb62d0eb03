"""`neuron-train bench`: result files for train and infer, sweeps, failures, instance detection."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from neuron_train import cli
from neuron_train.common.errors import UsageError
from neuron_train.cost.bench.failures import MeasureFailed, classify_failure
from neuron_train.cost.bench.instance import detect_instance_type, resolve_instance_type
from neuron_train.cost.bench.measure import Measurement, step_time_ms
from neuron_train.cost.bench.sweep import SweepPlan, sweep
from neuron_train.cost.schema import validate_result
from neuron_train.training.summary import RunSummary
from tests.conftest import ROOT, cpu_env
from tests.training.test_run_summary import WRITTEN


@pytest.fixture(autouse=True)
def _no_metadata_service(monkeypatch):
    """Tests never contact 169.254.169.254: detection is off unless a test points it at a stub."""
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", raising=False)


def bench(*argv: object) -> int:
    return cli.main(["bench", *map(str, argv)])


def test_infer_sweep_writes_a_valid_result(tmp_path, capsys):
    out = tmp_path / "infer.json"
    assert bench("--mode", "infer", "--sweep", "--sweep-batch-sizes", "4,8", "--repeats", "2",
                 "--max-steps", "6", "--warmup-measure-steps", "1", "--output", out) == 0
    r = validate_result(json.loads(out.read_text()), str(out))
    assert (r["mode"], r["instance_type"], r["instance_type_source"]) == ("infer", "local", "default")
    assert r["device"] == {"kind": "CPU", "count": 1, "tracer": "torch-xla"}
    assert r["model"]["name"] == "vit-digits" and r["model"]["parameters"] > 100_000
    assert r["dataset"] == {"name": "digits", "train_samples": 1497}
    assert (r["warmup_steps"], r["measured_steps"], r["repeats"]) == (1, 5, 2)
    assert r["compile"]["graph_count"] >= 1 and r["compile"]["time_s"] > 0
    rows = r["sweep"]
    assert [(x["batch_size_per_device"], x["status"]) for x in rows] == [(4, "ok"), (8, "ok")]
    best = max(rows, key=lambda x: x["samples_per_sec"])
    assert r["batch_size_per_device"] == best["batch_size_per_device"]
    assert best["samples_per_sec"] in r["samples_per_sec"]["values"]  # the sweep run is repeat 1
    assert f"--batch-size {r['batch_size_per_device']}" in r["command"]
    assert "CPU XLA device" in capsys.readouterr().out


@pytest.mark.slow
def test_train_sweep_runs_our_loop_and_records_a_failed_size(tmp_path):
    """Batch 16 trains; batch 4096 exceeds the digits training set: a recorded failure, not a crash."""
    out = tmp_path / "train.json"
    proc = subprocess.run(
        [sys.executable, "-m", "neuron_train", "bench", "--mode", "train", "--sweep",
         "--sweep-batch-sizes", "16,4096", "--repeats", "1", "--max-steps", "4",
         "--warmup-measure-steps", "1", "--num-workers", "0", "--instance-type", "trn1.2xlarge",
         "--output", str(out)],
        cwd=ROOT, env=cpu_env(AWS_EC2_METADATA_DISABLED="true"), capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = validate_result(json.loads(out.read_text()), str(out))
    assert (r["mode"], r["instance_type"], r["instance_type_source"]) == ("train", "trn1.2xlarge", "flag")
    assert r["device"]["kind"] == "CPU"          # measured on CPU, whatever the instance type says
    assert r["batch_size_per_device"] == 16 and r["global_batch_size"] == 16 and r["world_size"] == 1
    assert r["measured_steps"] == 3 and r["compile"]["graph_count"] >= 1
    assert math.isfinite(r["details"]["final_loss"])
    # 3 steps: too few for a median when the captured step's host runs ahead (then the window's mean)
    assert r["details"]["step_time_ms_from"] in ("median of steps", "window mean (too few steps for a median)")
    ok, failed = r["sweep"]
    assert ok["status"] == "ok" and ok["samples_per_sec"] == r["samples_per_sec"]["median"]
    assert failed["batch_size_per_device"] == 4096 and failed["status"] == "failed"
    assert "less than one step" in failed["reason"]
    assert "CPU XLA device" in proc.stdout


def test_a_run_too_short_for_a_step_median_is_recorded_with_its_window_mean():
    """training/throughput.py gives no median where the laps timed the host running ahead; the record then
    takes the window's mean step (global batch / samples/s) and says so."""
    timed = RunSummary.from_json(WRITTEN)
    assert step_time_ms(timed) == (49.75, "median of steps")
    short = RunSummary.from_json({**WRITTEN, "step_time_ms_median": None, "step_time_ms_spread": None})
    ms, what = step_time_ms(short)
    assert ms == pytest.approx(16 / 321.5 * 1e3) and what.startswith("window mean")


@pytest.mark.slow
def test_train_with_two_processes_measures_a_two_rank_run(tmp_path):
    """--nproc 2 runs our loop under torchrun: the result's world size and global batch come from
    the run's own summary, so a bench that quietly ran one process would say world size 1."""
    out = tmp_path / "two.json"
    proc = subprocess.run(
        [sys.executable, "-m", "neuron_train", "bench", "--mode", "train", "--nproc", "2", "--repeats", "1",
         "--model", "vit-nano", "--batch-size", "8", "--max-steps", "5", "--warmup-measure-steps", "2",
         "--eval-every", "100", "--num-workers", "0", "--output", str(out)],
        cwd=ROOT, env=cpu_env(AWS_EC2_METADATA_DISABLED="true"), capture_output=True, text=True,
        timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = validate_result(json.loads(out.read_text()), str(out))
    assert (r["mode"], r["world_size"], r["device"]["count"]) == ("train", 2, 2)
    assert (r["batch_size_per_device"], r["global_batch_size"]) == (8, 16)
    assert r["measured_steps"] == 3 and r["samples_per_sec"]["median"] > 0
    assert math.isfinite(r["details"]["final_loss"])
    assert "--nproc 2" in r["command"]


def test_sweep_stops_growing_the_batch_after_out_of_memory():
    tried = []

    def measure(bs: int, nproc: int) -> Measurement:
        tried.append((nproc, bs))
        if bs * nproc >= 64:
            raise MeasureFailed("oom", "RuntimeError: Out of memory allocating 2199023255552 bytes.")
        return Measurement(100.0 * bs, 10.0, 1.0, 2, 5, nproc, bs * nproc, "CPU")

    rows, ok = sweep(SweepPlan("train", [16, 32, 64, 128], [1, 2], 1), measure, lambda _: None)
    assert tried == [(1, 16), (1, 32), (1, 64), (2, 16), (2, 32)]
    assert [(r.world_size, r.batch_size_per_device, r.status) for r in rows] == [
        (1, 16, "ok"), (1, 32, "ok"), (1, 64, "oom"), (2, 16, "ok"), (2, 32, "oom")]
    assert rows[2].reason.endswith("(larger batch sizes not tried)")
    assert set(ok) == {(1, 16), (1, 32), (2, 16)}


@pytest.mark.parametrize("returncode, output, status, reason", [
    # recorded on this machine: torch_xla 2.9 CPU client, a 2 TiB allocation
    (1, "Traceback ...\nRuntimeError: Out of memory allocating 2199023255552 bytes.", "oom",
     "Out of memory allocating"),
    # recorded on this machine: torch's CPU allocator
    (1, "RuntimeError: [enforce fail at alloc_cpu.cpp:124] err == 0. DefaultCPUAllocator: can't "
        "allocate memory: you tried to allocate 4398046511104 bytes. Error code 12", "oom",
     "can't allocate memory"),
    # the Neuron runtime's device OOM line, as the Neuron documentation shows it (device-memory.rst)
    (1, "2025-May-15 20:58:33.897479 224822:224822 ERROR  TDRV:log_dev_mem    Failed to allocate "
        "4.000GB (alignment: none, usage: tensors) on ND 0:NC 4", "oom", "Failed to allocate 4.000GB"),
    (-9, "", "oom", "SIGKILL"),
    (2, "loading...\nneuron-train train: error: the digits training set (1497 samples) has less than "
        "one step of 4096 x 1 x 1 ranks", "failed", "less than one step"),
])
def test_failures_are_classified_from_real_messages(returncode, output, status, reason):
    failure = classify_failure(returncode, output)
    assert failure.status == status and reason in failure.reason


class _Imds(BaseHTTPRequestHandler):
    """Stand-in for the EC2 instance metadata service (IMDSv2) on 127.0.0.1: tests OUR client of
    its documented protocol (PUT /latest/api/token, then GET with X-aws-ec2-metadata-token)."""

    token, instance_type, calls = "tok-123", "trn1.2xlarge", []

    def do_PUT(self):  # noqa: N802 (http.server naming)
        type(self).calls.append(("PUT", self.path))
        ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        self._reply(200 if ok else 400, self.token if ok else "")

    def do_GET(self):  # noqa: N802
        type(self).calls.append(("GET", self.path))
        if self.headers.get("X-aws-ec2-metadata-token") != self.token:
            return self._reply(401, "")
        if self.path == "/latest/meta-data/instance-type":
            return self._reply(200, self.instance_type)
        self._reply(404, "")

    def _reply(self, code: int, body: str) -> None:
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def imds(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Imds)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Imds.calls = []
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "false")
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{server.server_port}/")
    yield _Imds
    server.shutdown()


def test_instance_type_from_the_metadata_service(imds):
    assert detect_instance_type() == "trn1.2xlarge"
    assert imds.calls == [("PUT", "/latest/api/token"), ("GET", "/latest/meta-data/instance-type")]
    assert resolve_instance_type(None) == ("trn1.2xlarge", "ec2-metadata")
    assert resolve_instance_type("trn1.2xlarge") == ("trn1.2xlarge", "ec2-metadata")
    with pytest.raises(UsageError, match="contradicts this machine"):
        resolve_instance_type("inf2.xlarge")


def test_instance_type_off_ec2(monkeypatch):
    assert detect_instance_type() is None                                    # disabled
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "false")
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    assert detect_instance_type(timeout=0.5) is None
    assert resolve_instance_type("inf2.xlarge") == ("inf2.xlarge", "flag")
    assert resolve_instance_type(None) == ("local", "default")


def test_bench_refuses_training_on_inf1(tmp_path, capsys):
    assert bench("--mode", "train", "--instance-type", "inf1.xlarge", "--output", tmp_path / "r.json") == 2
    err = capsys.readouterr().err
    assert "inf1.xlarge cannot train" in err and "inference-only" in err and "--mode infer" in err


def test_bench_never_overwrites_a_result(tmp_path, capsys):
    out = tmp_path / "r.json"
    out.write_text("{}")
    assert bench("--mode", "infer", "--output", out) == 2
    assert "exists" in capsys.readouterr().err and out.read_text() == "{}"
    assert bench("--mode", "infer", "--output-dir", tmp_path / "run", "--output", tmp_path / "s.json") == 2
    assert "drop --output-dir" in capsys.readouterr().err


@pytest.mark.neuron
def test_infer_on_neuron_traces_for_the_neuron_cores(tmp_path):
    """On trn1/inf2 the forward pass is compiled by torch_neuronx.trace and timed on every NeuronCore
    of the instance at once (inf1 is refused: scripts/inf1_bench.py measures it)."""
    out = tmp_path / "neuron.json"
    assert bench("--mode", "infer", "--repeats", "1", "--max-steps", "8", "--output", out) == 0
    r = validate_result(json.loads(out.read_text()), str(out))
    assert r["device"]["kind"] == "NEURON"
    assert r["device"]["tracer"] == "torch-neuronx"
    assert r["device"]["count"] == r["device"]["cores_total"] == r["world_size"]
    assert r["device"]["threads_per_core"] == 2  # NeuronPerf's published setting
    assert r["compile"]["graph_count"] == 1 and r["samples_per_sec"]["median"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--mode", "infer", "--nproc", "2"], "infer mode runs in one process"),
    (["--mode", "train", "--sweep-batch-sizes", "8,16"], "need --sweep"),
    (["--mode", "train", "--repeats", "0"], "--repeats must be >= 1"),
    (["--mode", "infer", "--max-steps", "2", "--warmup-measure-steps", "3"], "leaves no step"),
])
def test_bench_usage_errors_are_one_line(tmp_path, capsys, argv, message):
    assert bench(*argv, "--output", tmp_path / "r.json") == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "r.json").exists()
