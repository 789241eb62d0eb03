"""`neuron-train check-graphs` on real third-party PyTorch/XLA scripts (tests/corpus/SOURCES.md).

Every unmodified script must be judged graph-stable: exit 0, no recompilation, no problem. Every
planted copy carries one bug on a line marked `# PLANTED: <cause>`; its report must name that
cause at that line, and every problem it lists must be about that line (a second finding would be
a false alarm), except the failed command's own exit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_train.graphs import causes
from tests.conftest import ROOT, cpu_env

CORPUS = ROOT / "tests" / "corpus"
XLA = CORPUS / "pytorch_xla"
MLP = CORPUS / "neuron_mnist_mlp"
DECODER = ["--num-steps", "12", "--hidden-size", "64", "--num-attention-heads", "4",
           "--num-key-value-heads", "2", "--intermediate-size", "128"]
MNIST = ["--fake_data", "--batch_size", "32", "--target_accuracy", "0", "--log_steps", "5"]
IMAGENET = ["--fake_data", "--model", "resnet18", "--batch_size", "8", "--test_set_batch_size", "8",
            "--num_epochs", "2", "--num_steps", "6", "--log_steps", "3",
            "--lr_scheduler_type", "WarmupAndExponentialDecayScheduler", "--lr_scheduler_divisor", "5",
            "--lr_scheduler_divide_every_n_epochs", "20"]
_PLANTED = re.compile(r"#\s*PLANTED:\s*(?P<cause>[^(]+?)\s*(\(|$)")
# The planted comment's words for a cause the report has no single constant for.
LATE = "late graph"
RECOMPILE_CAUSES = {causes.NEW_INPUT_SHAPE, causes.DATA_DEPENDENT, causes.NEW_CONSTANT,
                    causes.GRAPH_STRUCTURE}
HOST_CAUSES = {causes.HOST_ACCESS, causes.VALUE_BRANCH}

pytestmark = pytest.mark.skipif(
    not (XLA / "train_resnet_base.py").exists() or not (MLP / "train.py").exists(),
    reason="the upstream scripts are not in this checkout: tests/corpus/SOURCES.md says where they come from")


def check_graphs(cwd: Path, *command: str, timeout: int = 900) -> tuple[int, dict, str]:
    """`neuron-train check-graphs --json FILE -- COMMAND` in `cwd`: exit code, report, output."""
    report = cwd / f"report-{len(list(cwd.glob('report-*.json')))}.json"
    proc = subprocess.run([sys.executable, "-m", "neuron_train", "check-graphs", "--json", str(report),
                           "--", *command], env=cpu_env(), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    output = proc.stdout + proc.stderr
    assert report.exists(), output
    return proc.returncode, json.loads(report.read_text()), output


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`run(script, *args)`: check-graphs on a corpus script, once per module (several tests read
    the same report)."""
    done: dict[tuple, tuple[int, dict, str]] = {}

    def run_script(script: Path, *args: str) -> tuple[int, dict, str]:
        if (script, args) not in done:
            done[script, args] = check_graphs(tmp_path_factory.mktemp(script.stem), sys.executable,
                                              str(script), *args)
        return done[script, args]

    return run_script


def planted(script: Path) -> tuple[str, str]:
    """(cause, file:line) of the `# PLANTED: cause` comment, the one bug of a planted copy."""
    found = [(m["cause"].strip(), f"{script}:{n}")
             for n, line in enumerate(script.read_text().splitlines(), 1) if (m := _PLANTED.search(line))]
    assert len(found) == 1, f"{script} needs exactly one # PLANTED line, has {len(found)}"
    return found[0]


def assert_stable(code: int, report: dict, output: str) -> None:
    assert code == 0, output
    assert report["stable"] and report["problems"] == [] and report["recompiles"] == [], output


def assert_planted(script: Path, code: int, report: dict, output: str) -> None:
    cause, line = planted(script)
    name = f"{line} ({cause})"
    problems = [p for p in report["problems"] if not p.startswith("the command exited")]
    if cause == LATE:
        assert code == 0 and report["stable"], output
        assert any(g["where"] == line for g in report["late_graphs"]), f"{name}: {output}"
        return
    assert code == 1 and problems, output
    assert all(line.rpartition("/")[2] in p for p in problems), f"a problem not about {name}: {output}"
    if cause in RECOMPILE_CAUSES:
        assert any((g["cause"], g["where"]) == (cause, line) for g in report["recompiles"]), f"{name}: {output}"
    else:
        assert cause in HOST_CAUSES, f"unknown planted cause {cause!r}"
        [sync] = [h for h in report["host_syncs"] if h["executes_graph"]]
        assert (sync["cause"], sync["where"]) == (cause, line), f"{name}: {output}"
        assert report["recompiles"] == [], output


# ----- aws-neuron-samples mnist_mlp: the plain mark_step loop ---------------------------------
@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory) -> tuple[Path, tuple[int, dict, str]]:
    """train.py once; eval.py reads the checkpoint it writes."""
    cwd = tmp_path_factory.mktemp("mlp")
    return cwd, check_graphs(cwd, sys.executable, str(MLP / "train.py"))


@pytest.mark.slow  # runs check-graphs on a script: a process
def test_mlp_train_is_stable(mlp_run):
    _, (code, report, output) = mlp_run
    assert_stable(code, report, output)
    assert report["steps"] == 160 and report["distinct_graphs"] == 1  # 4 epochs of 40 batches; SGD


@pytest.mark.slow  # runs check-graphs on a script: a process
def test_mlp_eval_is_stable(mlp_run):
    """`match_count = 0; match_count += ...`: the first eval batch's graph is the site's warm-up."""
    cwd, _ = mlp_run
    code, report, output = check_graphs(cwd, sys.executable, str(MLP / "eval.py"))
    assert_stable(code, report, output)
    first, *_ = report["graphs"]
    assert first["kind"] == "warmup" and report["distinct_graphs"] >= 2


@pytest.mark.slow
def test_mlp_torchrun_two_processes_are_stable(tmp_path):
    code, report, output = check_graphs(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone",
                                        "--nproc_per_node=2", str(MLP / "train_torchrun.py"))
    assert_stable(code, report, output)
    assert sorted(p["rank"] for p in report["processes"]) == ["0", "1"]
    train = [g for g in report["graphs"] if g["where"].endswith("train_torchrun.py:65")]
    assert train and all(g["kind"] == "warmup" for g in train), output  # not "late": rendezvous is set-up


MLP_PLANTED = ["planted_ragged_batch.py", "planted_print_loss.py", "planted_tensor_branch.py",
               "planted_bool_mask.py", "planted_lr_from_zero.py", "planted_late_eval.py"]


@pytest.mark.slow  # runs check-graphs on a script: a process
@pytest.mark.parametrize("name", MLP_PLANTED)
def test_mlp_planted_bug_is_named(run, name):
    script = MLP / name
    assert_planted(script, *run(script))


@pytest.mark.slow  # runs check-graphs on a script: a process
def test_lr_from_zero_names_the_scheduler(run):
    _, report, output = run(MLP / "planted_lr_from_zero.py")
    [recompile] = report["recompiles"]
    assert "['lr'] = 0.005, set by the LambdaLR made at" in recompile["detail"], output


# ----- pytorch/xla examples and tests ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("script,args", [
    ("train_resnet_base.py", []),
    ("train_decoder_only_base.py", DECODER),
    ("test_train_mp_mnist.py", [*MNIST, "--num_epochs", "2"]),
    ("test_train_mp_imagenet.py", IMAGENET),
    # ZeroRedundancyOptimizer: a 3-op set-up graph, the first optimizer step's, a steady step's at one
    # site (3, 663, 861 ops) once passed for a graph growing every step
    ("test_train_mp_mnist_zero1.py", ["--fake_data", "--num_epochs", "1", "--batch_size", "512",
                                      "--target_accuracy", "0", "--num_workers", "0"]),
], ids=["resnet_base", "decoder_only", "mp_mnist", "mp_imagenet", "mp_mnist_zero1"])
def test_pytorch_xla_script_is_stable(tmp_path, script, args):
    code, report, output = check_graphs(tmp_path, sys.executable, str(XLA / script), *args)
    assert_stable(code, report, output)


@pytest.mark.slow
@pytest.mark.parametrize("script,args", [
    ("planted_item_in_step.py", [*MNIST, "--num_epochs", "1"]),
    ("planted_varying_slice.py", DECODER),
    ("planted_dynamic_padding.py", DECODER),
], ids=["item_in_step", "varying_slice", "dynamic_padding"])
def test_pytorch_xla_planted_bug_is_named(run, script, args):
    assert_planted(XLA / script, *run(XLA / script, *args))


@pytest.mark.slow
def test_dynamic_padding_names_the_collate_fn_and_shapes(run):
    """The batch's shape is made in the collate_fn, behind MpDeviceLoader: no user line moves it."""
    _, report, output = run(XLA / "planted_dynamic_padding.py", *DECODER)
    first = report["recompiles"][0]
    assert "collate_fn TrainDecoderOnlyBase.__init__.<locals>.pad_to_longest" in first["detail"], output
    assert re.search(r"input \d+ by step: .*s64\[4,32\].*s64\[4,\d\d\]", first["detail"]), output


@pytest.mark.slow  # runs check-graphs on a script: a process
def test_crash_inside_torch_xla_compile_is_the_commands_own_error(run):
    """`.item()` inside torch_xla.compile(full_graph=True): torch_xla raises; the report says so."""
    script = XLA / "planted_item_in_compile.py"
    code, report, output = run(script)
    assert_planted(script, code, report, output)
    error = "RuntimeError: Unexpected execution happens inside the compiled function"
    assert f"the command exited with code 1: {error}, exiting" in report["problems"], output
    assert any(error in line for line in report["command_tail"])
    start = output.index("Traceback")  # the command's own stderr, after the report's excerpt of it
    traceback = output[start:output.index(error, start)]
    assert "neuron_train" not in traceback and os.path.basename(str(script)) in traceback, traceback
    assert all(g["hash"] or g["detail"].startswith("no hash: ") for g in report["graphs"]), output


def test_corpus_sources_cover_every_script():
    """SOURCES.md names every script here (and its change), so the corpus stays traceable."""
    sources = (CORPUS / "SOURCES.md").read_text()
    scripts = sorted(p.name for p in CORPUS.rglob("*.py") if p.name != "synthetic_mnist.py")
    missing = [name for name in scripts if name not in sources]
    assert not missing, missing
