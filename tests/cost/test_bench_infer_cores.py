"""`bench --mode infer` on trn1/inf2 gets its NeuronCores (issue 32, finding 2).

Runs the real bench code (cost/bench/measure.py's Neuron path, percore.py, core_worker.py in real
processes) against a STAND-IN for torch-neuronx and the Neuron runtime's core reservation
(tests/fixtures/neuron_standin/torch_neuronx): it tests only our contract with them (who traces,
which process holds which core, when), never the compiler, the runtime or any figure.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from neuron_train.cost.bench.failures import MeasureFailed
from neuron_train.cost.bench.measure import InferBench
from neuron_train.training.config import RunConfig
from tests.conftest import ROOT

STANDIN = ROOT / "tests" / "fixtures" / "neuron_standin"


@pytest.fixture
def neuron_standin(tmp_path, monkeypatch):
    """Two stand-in NeuronCores; processes started from here import the stand-in torch_neuronx."""
    cores = tmp_path / "cores"
    cores.mkdir()
    log = tmp_path / "trace-calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", f"{STANDIN}{os.pathsep}{ROOT}")
    monkeypatch.setenv("STANDIN_NEURON_CORES_DIR", str(cores))
    monkeypatch.setenv("STANDIN_NEURON_CORES", "2")
    monkeypatch.setenv("STANDIN_NEURON_LOG", str(log))
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    monkeypatch.syspath_prepend(str(STANDIN))  # for code that would trace in this process
    monkeypatch.setattr(torch.jit, "load", torch.jit.load)  # the stand-in wraps it on import: restored after
    yield log
    standin = sys.modules.pop("torch_neuronx", None)
    for fd in getattr(standin, "_held", []):  # cores this test process reserved, released
        os.close(fd)


def neuron_bench(tmp_path) -> InferBench:
    """The bench of a trn1.2xlarge (2 NeuronCores), built as `bench --mode infer` builds it; the
    device flags are set by hand because this machine has no Neuron device."""
    bench = InferBench(RunConfig(), num_classes=10, instance_type="trn1.2xlarge", workdir=tmp_path)
    bench.on_neuron, bench.tracer, bench.cores_total = True, "torch-neuronx", 2
    return bench


@pytest.mark.slow  # a tracing process and two worker processes per measurement
def test_infer_on_neuron_traces_in_a_child_and_every_core_runs_a_worker(tmp_path, neuron_standin):
    bench = neuron_bench(tmp_path)
    first = bench.measure(4, 3, 1)
    again = bench.measure(4, 3, 1)  # the same batch size: the saved module is reused, nothing traced
    (call,) = [json.loads(line) for line in neuron_standin.read_text().splitlines()]
    assert call["pid"] != os.getpid()  # traced in a child process, which has exited
    assert call["compiler_args"] == ["--auto-cast", "none"]
    assert (first.world_size, first.global_batch_size, first.graph_count, again.graph_count) == (2, 8, 1, 0)
    assert first.device_info == {"tracer": "torch-neuronx", "compiler_args": "--auto-cast none",
                                 "threads_per_core": 2, "cores_total": 2}
    assert first.samples_per_sec > 0


@pytest.mark.slow
def test_the_core_reservation_stand_in_fails_workers_while_a_tracer_lives(tmp_path, neuron_standin):
    """The rule the fix depends on, shown on the stand-in: once this process has traced, it holds
    every core, and the workers fail as on Neuron hardware."""
    import torch_neuronx

    bench = neuron_bench(tmp_path)
    torch_neuronx.trace(bench.model, bench._input(1))
    with pytest.raises(MeasureFailed) as failed:
        bench.measure(4, 3, 1)
    assert "NeuronCore(s) not available" in failed.value.reason


def test_a_neuron_row_names_its_threads_per_core_and_casting():
    """Published rows run NeuronPerf's two threads per core with matmuls auto-cast to bf16: a row
    measured otherwise must say how it was measured, so no one compares unlike figures."""
    from neuron_train.cost.records import Device
    from neuron_train.cost.report.rows import device_text, precision_text

    device = Device("NEURON", 2, cores_total=2, tracer="torch-neuronx", threads_per_core=2)
    assert device_text(device) == "NEURON, torch-neuronx, 2 of 2 NeuronCores, 2 thread(s) per core"
    assert precision_text("fp32", "--auto-cast none") == "fp32 (compiler --auto-cast none: no auto-cast)"
    inf1 = Device("NEURON", 4, cores_total=4, tracer="torch-neuron", host_threads=1)
    assert device_text(inf1) == "NEURON, torch-neuron, 4 of 4 NeuronCores, 1 host thread(s)"  # not the published 4
    # neuron-cc's appnote says --fast-math none keeps matmuls 16-bit, not which 16-bit type
    assert precision_text("fp32", "--fast-math none") == \
        "fp32 (compiler --fast-math none: matmuls cast to 16-bit (neuron-cc's most precise))"
