"""Bring your own script (issue 14) on real third-party scripts (tests/corpus, SOURCES.md; skipped,
saying why, when they are absent): precompile then the real run's coverage, another batch size, an
evaluation the tour never reached, --require-precompiled, bench next to our loop's result in a
report, torch_xla.compile and torchrun scripts, and neuron_parallel_compile through a stand-in.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_train.precompile import store
from tests.conftest import ROOT, cpu_env
from tests.instrument.test_byos import nt

CORPUS = ROOT / "tests" / "corpus"
MLP = CORPUS / "neuron_mnist_mlp"
XLA = CORPUS / "pytorch_xla"
REPORT_FIXTURES = ROOT / "tests" / "fixtures" / "report"
MNIST_ARGS = ["--fake_data", "--num_epochs", "2", "--target_accuracy", "0", "--log_steps", "5"]
corpus = pytest.mark.skipif(
    not (MLP / "train.py").exists() or not (XLA / "train_resnet_base.py").exists(),
    reason="the upstream scripts are not in this checkout: tests/corpus/SOURCES.md says where they come from")
pytestmark = pytest.mark.slow  # every test runs precompile, check-graphs or bench on a script: processes


def copy_mlp(to: Path, **constants: int) -> Path:
    """The aws-neuron-samples mnist_mlp folder in `to`, with constants (EPOCHS, BATCH_SIZE) changed."""
    to.mkdir(parents=True)
    for name in ("train.py", "model.py", "synthetic_mnist.py", "planted_late_eval.py"):
        text = (MLP / name).read_text()
        for key, value in constants.items():
            text, n = re.subn(rf"^{key} = \d+", f"{key} = {value}", text, flags=re.M)
            assert n == 1 or name not in ("train.py",), (name, key)
        (to / name).write_text(text)
    return to


@corpus
def test_mnist_mlp_precompiled_then_covered_and_another_batch_size_stopped(tmp_path):
    """aws-neuron-samples mnist_mlp/train.py: the tour fast-forwards to its end, the real run is covered;
    a copy with batch 16 is stopped by --require-precompiled as its first graph's compile starts."""
    a = copy_mlp(tmp_path / "a")
    proc = nt(a, "precompile", "--cache-dir", str(tmp_path / "cc"), "--", sys.executable, "train.py")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    forwarded = re.search(r"tour +fast-forwarded after step (\d+)", out)
    assert forwarded and 40 < int(forwarded.group(1)) < 160, out  # past the first epoch's end (40 steps)
    assert "Final loss" in out  # the code after the loop ran (4 epochs of 40 steps were not run)
    manifest = store.load_manifest(tmp_path / "cc")
    (record,) = manifest.configs.values()
    (graph,) = record.graphs.values()
    assert graph.extra["where"] == f"{a / 'train.py'}:51" and "f32[32,784]" in graph.extra["input_shapes"]

    proc = nt(a, "check-graphs", "--compile-cache", str(tmp_path / "cc"), "--require-precompiled", "--",
              sys.executable, "train.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "precompile coverage 100% (1/1 graphs" in proc.stdout and "Final loss" in proc.stdout

    b = copy_mlp(tmp_path / "b", BATCH_SIZE=16)
    proc = nt(b, "check-graphs", "--compile-cache", str(tmp_path / "cc"), "--require-precompiled", "--",
              sys.executable, "train.py")
    assert proc.returncode == 1
    stopped = next(ln for ln in proc.stdout.splitlines() if ln.startswith("--require-precompiled stopped"))
    assert "from train.py:51 " in stopped and "before it finished" in stopped  # relative to the run's folder
    assert "input 6: f32[16,784] here, f32[32,784] in the manifest" in stopped
    assert "Train throughput" not in proc.stdout  # stopped in its first step


@corpus
def test_bench_of_a_script_agrees_with_its_own_rate_and_is_priced_next_to_our_loop(tmp_path):
    """mnist_mlp/train.py prints its own rate over its last epoch's steps 2..39 (37 steps counted for 38
    timed: 2.7% low); with one epoch the bench measures the same steps from the syncs, so the two
    must agree within 10%."""
    work = copy_mlp(tmp_path / "w", EPOCHS=1)
    proc = nt(work, "bench", "--steps", "0", "--output", str(tmp_path / "script.json"), "--",
              sys.executable, "train.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    own = float(re.search(r"Train throughput \(iter/sec\): ([\d.]+)", proc.stdout).group(1)) * 32
    result = json.loads((tmp_path / "script.json").read_text())
    assert result["batch_size_per_device"] == 32 and result["config"]["batch_shape"] == [32, 784]
    assert result["samples_per_sec"]["median"] == pytest.approx(own, rel=0.10)
    assert result["model"]["parameters"] == 784 * 120 + 120 + 120 * 84 + 84 + 84 * 10 + 10

    proc = nt(tmp_path, "report", str(tmp_path / "script.json"), str(REPORT_FIXTURES / "cpu_train_vit_digits.json"),
              "--reference", str(REPORT_FIXTURES / "trn1_training_data_vision_transformers.csv"),
              "--out", str(tmp_path / "rep"))
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "rep" / "report.md").read_text()
    for title in ("## Training · train.py", "## Training · vit-digits", "## Training · HuggingFace ViT-Base"):
        assert title in report
    assert f"{result['samples_per_sec']['median']:,.1f} samples" in report


@corpus
@pytest.mark.slow
def test_an_evaluation_the_tour_never_reached_is_named_with_its_line(tmp_path):
    """planted_late_eval.py (mnist_mlp/train.py + an evaluation after training): the default tour
    runs past the first epoch's end and precompiles the evaluation; a tour cut at 5 steps
    (--steps 5) does not, and the real run's evaluation graph is named with its line."""
    work = copy_mlp(tmp_path / "w", EPOCHS=1)
    proc = nt(work, "precompile", "--cache-dir", "full", "--", sys.executable, "planted_late_eval.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = nt(work, "check-graphs", "--compile-cache", "full", "--", sys.executable, "planted_late_eval.py")
    assert "precompile coverage 100% (2/2 graphs" in proc.stdout, proc.stdout

    proc = nt(work, "precompile", "--cache-dir", "cc", "--steps", "5", "--", sys.executable, "planted_late_eval.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = nt(work, "check-graphs", "--compile-cache", "cc", "--", sys.executable, "planted_late_eval.py")
    late = next(n for n, line in enumerate((work / "planted_late_eval.py").read_text().splitlines(), 1)
                if "PLANTED" in line)
    assert "precompile coverage 50% (1/2 graphs" in proc.stdout, proc.stdout
    assert (f"at planted_late_eval.py:{late} (late, step 41): no precompiled graph comes from "
            f"planted_late_eval.py:{late}: the precompile run never reached that line") in proc.stdout, proc.stdout
    assert proc.returncode == 0  # coverage is reported; only --require-precompiled fails the run


@corpus
@pytest.mark.slow
def test_mp_mnist_another_batch_size_names_each_graph_and_its_difference(tmp_path):
    """pytorch/xla test/test_train_mp_mnist.py (torch_xla.launch, MpDeviceLoader, SGD momentum, an
    evaluation each epoch): run whole (--steps 0) the tour covers the real run; at batch 16 every
    training graph is named with the input shapes that changed."""
    script = str(XLA / "test_train_mp_mnist.py")
    proc = nt(tmp_path, "precompile", "--cache-dir", "cc", "--steps", "0", "--", sys.executable, script,
              *MNIST_ARGS, "--batch_size", "32")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = nt(tmp_path, "check-graphs", "--compile-cache", "cc", "--require-precompiled", "--", sys.executable,
              script, *MNIST_ARGS, "--batch_size", "32")
    assert proc.returncode == 0 and "precompile coverage 100% (7/7 graphs" in proc.stdout, proc.stdout
    proc = nt(tmp_path, "check-graphs", "--compile-cache", "cc", "--", sys.executable, script, *MNIST_ARGS,
              "--batch_size", "16")
    missing = [ln for ln in proc.stdout.splitlines() if ln.startswith("  not precompiled:")]
    # the first and the steady training step, the first and the steady evaluation batch; the
    # set-up broadcast and the accuracy's graphs do not depend on the batch size
    assert len(missing) == 4 and "precompile coverage 43% (3/7 graphs" in proc.stdout, proc.stdout
    for line in missing:
        assert re.search(r"test_train_mp_mnist\.py:(151|171)", line), line
        assert "f32[16,1,28,28] here, f32[32,1,28,28] in the manifest" in line, line
    assert "--batch_size 16 here, 32 in the manifest" in proc.stdout


@corpus
@pytest.mark.slow
@pytest.mark.parametrize("command", [
    ["{py}", str(XLA / "train_resnet_base.py")],
    ["{py}", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_torchrun.py"],
], ids=["resnet_base_torch_xla_compile", "mlp_torchrun_2_processes"])
def test_precompile_then_the_real_run_is_fully_covered(tmp_path, command):
    """pytorch/xla examples/train_resnet_base.py (torch_xla.compile(full_graph=True)) and
    aws-neuron-samples mnist_mlp/train_torchrun.py under torchrun with 2 processes."""
    shutil.copy(MLP / "train_torchrun.py", tmp_path)
    for name in ("model.py", "synthetic_mnist.py"):
        shutil.copy(MLP / name, tmp_path)
    command = [sys.executable if c == "{py}" else c for c in command]
    proc = nt(tmp_path, "precompile", "--cache-dir", "cc", "--", *command)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "graph tour complete" in proc.stdout + proc.stderr
    proc = nt(tmp_path, "check-graphs", "--compile-cache", "cc", "--require-precompiled", "--", *command)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"precompile coverage 100% \((\d+)/\1 graphs", proc.stdout)


@corpus
@pytest.mark.slow
def test_neuron_parallel_compile_contract_for_a_script_through_a_stand_in(tmp_path):
    """Our side of the contract only: tests/fixtures/precompile/bin/neuron_parallel_compile is a
    STAND-IN that compiles nothing (it runs the command with NEURON_EXTRACT_GRAPHS_ONLY=1 and prints
    a recorded summary). Checked: how precompile calls it, the environment the command gets, that
    our instrumentation reaches the command through it, and the relayed summary."""
    work = copy_mlp(tmp_path / "w")
    seen_file = tmp_path / "standin.json"
    env = cpu_env(PATH=f"{ROOT / 'tests' / 'fixtures' / 'precompile' / 'bin'}{os.pathsep}{os.environ['PATH']}",
                  STANDIN_RECORD=str(seen_file))
    proc = subprocess.run([sys.executable, "-m", "neuron_train", "precompile", "--target", "neuron", "--num-parallel",
                           "2", "--cache-dir", str(tmp_path / "cc"), "--", sys.executable, "train.py"],
                          env=env, cwd=work, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(seen_file.read_text())
    assert seen["options"] == {"--num_parallel": "2"} and seen["command"] == [sys.executable, "train.py"]
    assert seen["env"]["NEURON_CC_FLAGS"] == f"--cache_dir={tmp_path / 'cc'}"
    assert seen["env"]["NEURON_PARALLEL_COMPILE_MAX_RETRIES"] == "1"
    assert seen["env"]["NEURON_TRAIN_PROBE_MODE"] == "tour"
    assert "graph tour complete" in proc.stdout + proc.stderr
    assert "neuron_parallel_compile: 2 graphs, 2 compiled, 0 failed" in proc.stdout
    (record,) = store.load_manifest(tmp_path / "cc").configs.values()
    assert record.config["script"] == f"{sys.executable} train.py" and len(record.graphs) == 1


@corpus
@pytest.mark.neuron
def test_a_script_precompiled_on_neuron_compiles_nothing_new(tmp_path):
    """On a trn1/inf2 host: neuron_parallel_compile for real, then the real run is fully covered
    and --require-precompiled lets it through."""
    work = copy_mlp(tmp_path / "w")
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "neuron_train", "precompile", "--cache-dir", str(tmp_path / "cc"),
                           "--", sys.executable, "train.py"], env=env, cwd=work, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert any(e.state == store.COMPILED for e in store.scan(tmp_path / "cc"))
    proc = subprocess.run([sys.executable, "-m", "neuron_train", "check-graphs", "--compile-cache",
                           str(tmp_path / "cc"), "--require-precompiled", "--", sys.executable, "train.py"],
                          env=env, cwd=work, capture_output=True, text=True)
    assert proc.returncode == 0 and "precompile coverage 100%" in proc.stdout, proc.stdout[-3000:]
