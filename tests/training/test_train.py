"""End-to-end training on the CPU XLA device: learning, data parallelism, resume, outputs."""

from __future__ import annotations

import json
import math
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from neuron_train.training.checkpoint import list_checkpoints
from tests.conftest import NANO, ROOT, RUN_PY, cpu_env, run_train, summary_of
from tests.test_readme import setup_commands


def final_weights(out):
    return torch.load(list_checkpoints(out)[-1], weights_only=True)["model"]


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= atol, f"largest weight difference {worst} > {atol}"


def resume_ends_like_the_full_run(tmp_path: Path, args: list[str], at_step: int) -> Path:
    """Train `args` uninterrupted, then again resumed from the full run's step-`at_step` checkpoint: the
    resumed run must end with the same weights. Returns the resumed run's folder."""
    from neuron_train.training.checkpoint import checkpoint_dir

    full = run_train(tmp_path / "full", *args)
    assert full.returncode == 0, full.stderr[-3000:]
    resumed = run_train(tmp_path / "resumed", *args, "--resume",
                        str(checkpoint_dir(tmp_path / "full") / f"step-{at_step:08d}.pt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(final_weights(tmp_path / "resumed"), final_weights(tmp_path / "full"), atol=1e-6)
    return tmp_path / "resumed"


def readme_first_command() -> list[str]:
    """The README's first command without its install part: `torchrun ... neuron_train/run.py ...`."""
    return shlex.split(setup_commands()[0].split("&&")[-1])


def readme_first_command_graphs() -> int:
    """The graph count the README states for its first command ("... N graphs compiled ...")."""
    opening = (ROOT / "README.md").read_text().split("## ")[0]
    return int(re.search(r"first command.*?(\d+) graphs compiled", opening, re.S).group(1))


@pytest.mark.slow
def test_the_readme_first_command_keeps_its_promise(tmp_path):
    """Exactly the README's first command (2 ranks under torchrun, the default step path), run from an
    empty folder as a new user would: >= 90% accuracy, the graph count the README states, no train
    graph after the warm-up steps, the summary printed, every logged step in metrics.jsonl."""
    argv = readme_first_command()
    assert argv[:2] == ["torchrun", "--standalone"] and "--nproc_per_node=2" in argv, argv
    script = argv.index("neuron_train/run.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", *argv[1:script], str(RUN_PY), *argv[script + 1:]]
    proc = subprocess.run(cmd, cwd=tmp_path, env=cpu_env(), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    s = summary_of(run_dir)
    assert s["world_size"] == 2 and s["global_batch_size"] == 64, s
    assert s["eval_accuracy"] >= 0.90, s
    assert s["compile_count"] == readme_first_command_graphs(), s
    graphs = json.loads((run_dir / "graphs.json").read_text())
    assert graphs["stable"] and graphs["recompiles"] == [], graphs["problems"]
    assert all(g["step"] <= 1 for g in graphs["graphs"] if g["phase"] == "train"), graphs["graphs"]
    assert s["samples_per_sec"] > 0 and s["step_time_ms_median"] > 0
    assert "eval accuracy" in proc.stdout and "samples/s" in proc.stdout   # the final summary
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "train"]
    assert logged == [k for k in range(s["steps"]) if k % 10 == 0 or k == s["steps"] - 1]
    assert (run_dir / "config.yaml").is_file()


@pytest.mark.slow
def test_two_processes_match_one_process_on_the_same_global_batch(tmp_path):
    common = ["--max-steps", "6", "--warmup-steps", "2", "--eval-every", "100"]
    two = run_train(tmp_path / "two", *NANO, *common, "--batch-size", "16", nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_train(tmp_path / "one", *NANO, *common, "--batch-size", "32")
    assert one.returncode == 0, one.stderr[-3000:]
    s2 = summary_of(tmp_path / "two")
    assert s2["world_size"] == 2 and s2["global_batch_size"] == 32
    c = s2["param_checksums"]
    assert len(c) == 2 and c[0] == c[1], "ranks ended with different weights"
    assert_same_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"), atol=2e-4)


def _wait_until(done, what, proc, timeout=600):
    """Poll `done()` until it holds; fail if the run ends first or after `timeout` seconds."""
    end = time.time() + timeout
    while time.time() < end:
        if done():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before {what}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {what} after {timeout} s")


def _wait_for(path_glob, out, proc, timeout=600):
    _wait_until(lambda: bool(list(out.glob(path_glob))), path_glob, proc, timeout)


@pytest.mark.slow
def test_a_short_run_whose_host_runs_ahead_states_no_step_time(tmp_path):
    """The captured step (the CPU default) launches a ViT-Tiny step at 64 px in a fraction of its device
    time: over a 10-step run's 5 measured steps the laps timed the host (39.7 ms "median" against 311 ms
    steps by samples/s, before training/throughput.py's rule). samples/s stands; the median is not given."""
    out = tmp_path / "run"
    proc = run_train(out, "--model", "vit_tiny_patch16_224", "--img-size", "64", "--num-classes", "1000",
                     "--batch-size", "32", "--dataset", "synthetic", "--max-steps", "10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary_of(out)
    assert s["samples_per_sec"] > 0 and s["measured_steps"] >= 4, s
    assert s["step_time_ms_median"] is None and s["step_time_ms_spread"] is None, s
    assert "step time n/a (too few steady steps to time one: raise --max-steps)" in proc.stdout


@pytest.mark.slow
def test_a_run_no_longer_than_its_warm_up_states_no_speed(tmp_path):
    """3 steps, all warm-up: the clock started at the last one and measured none (it printed 0.0 samples/s)."""
    out = tmp_path / "run"
    proc = run_train(out, *NANO, "--max-steps", "3", "--warmup-measure-steps", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary_of(out)
    assert s["measured_steps"] == 0 and s["samples_per_sec"] is None and s["step_time_ms_median"] is None, s
    assert "speed      n/a samples/s, step time n/a" in proc.stdout


@pytest.mark.slow
def test_killed_and_resumed_run_matches_an_uninterrupted_one(tmp_path):
    args = ["--max-steps", "16", "--checkpoint-every", "4", "--eval-every", "100", "--warmup-steps", "3"]
    full = run_train(tmp_path / "full", *NANO, *args)
    assert full.returncode == 0, full.stderr[-2000:]

    out = tmp_path / "killed"
    cmd = [sys.executable, str(RUN_PY), "--output-dir", str(out), "--no-progress", "--no-tensorboard",
           "--num-workers", "0", *NANO, *args]
    proc = subprocess.Popen(cmd, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for("checkpoints/step-00000008.pt", out, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "summary.json").exists()

    resumed = run_train(out, *NANO, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    s = summary_of(out)
    assert s["resumed_from"].endswith(".pt") and s["steps"] == 16
    assert_same_weights(final_weights(out), final_weights(tmp_path / "full"), atol=1e-6)


@pytest.mark.slow
def test_sigterm_checkpoints_then_stops_and_resume_finishes(tmp_path):
    out = tmp_path / "run"
    args = ["--max-steps", "400", "--eval-every", "1000"]
    cmd = [sys.executable, str(RUN_PY), "--output-dir", str(out), "--no-progress", "--no-tensorboard",
           "--num-workers", "0", "--log-every", "1", *NANO, *args]
    proc = subprocess.Popen(cmd, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for("metrics.jsonl", out, proc)
    _wait_until(lambda: len((out / "metrics.jsonl").read_text().splitlines()) >= 3, "3 logged steps", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "continue with --resume" in err, err[-2000:]
    saved = list_checkpoints(out)
    assert len(saved) == 1
    step = int(saved[0].stem.split("-")[1])
    assert 3 <= step < 400
    again = run_train(out, *NANO, "--max-steps", str(step + 2), "--eval-every", "1000", "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert summary_of(out)["steps"] == step + 2


@pytest.mark.slow
def test_existing_run_is_never_overwritten_and_resume_needs_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    proc = run_train(out, *NANO, "--max-steps", "2")
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == "precious\n"
    proc = run_train(tmp_path / "empty", *NANO, "--max-steps", "2", "--resume")
    assert proc.returncode == 2 and "no checkpoint" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_extraction_mode_writes_nothing_and_stops_after_precompile_steps(tmp_path):
    out = tmp_path / "extract"
    proc = run_train(out, *NANO, "--epochs", "5", "--precompile-steps", "3",
                     env=cpu_env(NEURON_EXTRACT_GRAPHS_ONLY="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())
    assert int(re.search(r"^steps\s+(\d+) ", proc.stdout, re.M).group(1)) == 3


@pytest.mark.slow
@pytest.mark.parametrize("precision, env", [
    ("bf16-autocast", {}),
    ("bf16", {}),
    ("fp32", {"XLA_USE_BF16": "1"}),
])
def test_precision_modes_train(tmp_path, precision, env):
    out = tmp_path / precision
    proc = run_train(out, *NANO, "--max-steps", "4", "--precision", precision, "--eval-every", "100",
                     env=cpu_env(**env))
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = summary_of(out)
    assert s["precision"] == ("xla-use-bf16" if env else precision)
    assert isinstance(s["final_loss"], float) and math.isfinite(s["final_loss"])
    dtypes = {v.dtype for v in final_weights(out).values()}
    assert dtypes == ({torch.bfloat16} if precision == "bf16" else {torch.float32})


@pytest.mark.slow
def test_legacy_bf16_env_conflicting_with_flag_is_refused(tmp_path):
    proc = run_train(tmp_path / "x", *NANO, "--precision", "bf16", env=cpu_env(XLA_USE_BF16="1"))
    assert proc.returncode == 2 and "XLA_USE_BF16=1 is set" in proc.stderr


@pytest.mark.slow
def test_image_folder_dataset_takes_classes_from_the_folders(tmp_path):
    from PIL import Image

    for split, n in (("train", 12), ("val", 4)):
        for cls in ("cat", "dog", "eel"):
            d = tmp_path / "imgs" / split / cls
            d.mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (40, 30), color=(i * 20, len(cls) * 30, 99)).save(d / f"{i}.png")
    out = tmp_path / "run"
    proc = run_train(out, *NANO, "--dataset", "folder", "--data-dir", str(tmp_path / "imgs"),
                     "--batch-size", "4", "--max-steps", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = summary_of(out)
    assert s["steps"] == 3 and s["eval_accuracy"] is not None
    assert final_weights(out)["head.weight"].shape[0] == 3


@pytest.mark.slow
def test_resume_with_another_global_batch_is_refused(tmp_path):
    out = tmp_path / "run"
    assert run_train(out, *NANO, "--max-steps", "2").returncode == 0
    proc = run_train(out, *NANO, "--max-steps", "4", "--batch-size", "16", "--resume")
    assert proc.returncode == 2 and "global batch of 32" in proc.stderr, proc.stderr[-1000:]


@pytest.mark.parametrize("world, joined, xla_world, bridge, ok", [
    (2, 2, 1, True, True),     # CPU: one XLA device per process, joined through gloo
    (2, 1, 1, True, False),    # a rank missing from the gloo group
    (32, 32, 32, False, True),  # Neuron: the XLA world spans every rank
    (32, 32, 1, False, False),  # torchrun + 'xla' that did not join: 32 independent replicas
])
def test_world_size_disagreement_fails_loudly(world, joined, xla_world, bridge, ok):
    from neuron_train.common.errors import RunError
    from neuron_train.training.device import check_world

    if ok:
        check_world(world, joined, xla_world, bridge)
    else:
        with pytest.raises(RunError, match="refusing to train"):
            check_world(world, joined, xla_world, bridge)


@pytest.mark.slow
def test_every_step_path_trains_the_same_weights_and_resumes_the_others_checkpoints(tmp_path):
    """The default step path (dynamo-full, foreach) against dynamo, lazy for-loop (the path Neuron's
    samples use) and lazy flat (Neuron's default): the same weights after 6 steps, the flat path with
    the lazy path's graph count. And checkpoints written by the lazy paths resume under another path
    (LR tensor, step counters moved; flat buckets to torch's per-tensor state) at the same weights."""
    common = ["--eval-every", "100", "--warmup-steps", "2", "--schedule", "constant"]
    paths = {"default": [], "dynamo": ["--step-compiler", "dynamo"],
             "lazy": ["--step-compiler", "lazy", "--optimizer-impl", "for-loop"],
             "flat": ["--step-compiler", "lazy", "--optimizer-impl", "flat"]}
    for name, extra in paths.items():
        proc = run_train(tmp_path / name, *NANO, *common, "--max-steps", "6", *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
    default = final_weights(tmp_path / "default")
    for name in ("dynamo", "lazy", "flat"):
        assert_same_weights(final_weights(tmp_path / name), default, atol=1e-4)
    graphs = {name: summary_of(tmp_path / name)["compile_count"] for name in ("lazy", "flat")}
    assert graphs["flat"] == graphs["lazy"], graphs
    for first_path, then in (("lazy", []), ("flat", paths["lazy"])):
        out = tmp_path / f"switched-{first_path}"
        first = run_train(out, *NANO, *common, "--max-steps", "3", *paths[first_path])
        assert first.returncode == 0, first.stderr[-2000:]
        resumed = run_train(out, *NANO, *common, "--max-steps", "6", "--resume", "--check-graphs", *then)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert summary_of(out)["steps"] == 6
        assert_same_weights(final_weights(out), default, atol=1e-4)
