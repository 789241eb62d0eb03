"""scripts/bench_loop.py --outside: the in-run reading, timed from outside.

Each long run's steady step is read between two of its own log records as they appear (the plain loop's
`step N` lines, our loop's metrics.jsonl records), so start-up's spread between processes is left out.
Here: the records are read as both loops write them, and each is timed when it appears, not when the
process ends. The benchmark's figures themselves are in docs/measurements.md, not asserted here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

from neuron_train.training.metrics import MetricsWriter
from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("bench_loop", ROOT / "scripts" / "bench_loop.py")
bench_loop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_loop)

GAP = 0.6  # s between a stand-in's two records


def test_in_run_ms_is_the_time_between_step_10_s_record_and_the_last_over_the_steps_between():
    seen = {0: 1.0, 10: 5.0, 20: 7.5, 30: 10.0, 39: 12.25}  # step 0's record: after the compiles
    assert bench_loop.in_run_ms(seen) == (12.25 - 5.0) / 29 * 1e3
    assert bench_loop.in_run_ms({0: 1.0, 9: 3.0}) is None  # a 10-step run: nothing after start-up


def test_the_plain_loop_s_log_lines_are_read_and_nothing_else():
    assert bench_loop.plain_log_step("step 10 loss 6.9541\n") == 10
    assert bench_loop.plain_log_step("final loss 6.9541") is None
    assert bench_loop.plain_log_step("step ten") is None


def test_our_loop_s_metrics_records_are_read_as_its_writer_appends_them(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in (0, 10):
        writer.write(step, {"loss": 6.9, "grad_norm": 1.0, "lr": 1e-3})
    writer.write(10, {"eval_accuracy": 0.1, "eval_loss": 6.9}, kind="eval")
    writer.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert bench_loop.metrics_log_steps(text) == [0, 10]
    assert bench_loop.metrics_log_steps(text + '{"kind": "train", "st') == [0, 10]  # a record being written


def _standin(body: str, **popen) -> subprocess.Popen:
    """A process that writes two records GAP seconds apart, then lingers (as a run's teardown does)."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(body)], text=True, **popen)


def test_each_record_is_timed_when_our_loop_writes_it_not_when_the_run_ends(tmp_path):
    proc = _standin(f"""
        import json, os, time
        fd = os.open({str(tmp_path / "metrics.jsonl")!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        for step in (10, 20):
            os.write(fd, (json.dumps({{"kind": "train", "step": step}}) + "\\n").encode())
            time.sleep({GAP})
        time.sleep({GAP})
    """)
    seen = bench_loop.watch_logs(proc, "ours", tmp_path)
    assert sorted(seen) == [10, 20] and proc.returncode == 0
    assert seen[20] - seen[10] >= GAP - 0.05  # stamped on arrival: both at the end would give ~0


def test_each_line_is_timed_when_the_plain_loop_prints_it(tmp_path):
    proc = _standin(f"""
        import time
        for step in (10, 20):
            print(f"step {{step}} loss 6.9", flush=True)
            time.sleep({GAP})
        print("final loss 6.9")
    """, stdout=subprocess.PIPE)
    seen = bench_loop.watch_logs(proc, "plain", tmp_path)
    assert sorted(seen) == [10, 20] and proc.returncode == 0
    assert seen[20] - seen[10] >= GAP - 0.05


def test_a_long_run_of_ours_draws_one_epoch_so_no_epoch_end_evaluation_is_timed():
    # Our loop evaluates at each epoch's end; its default set (2,048 samples) is 64 steps of 32, so a
    # 100-step run evaluated at step 64, inside the timed steps, while the plain loop never evaluates.
    args = bench_loop.argparse.Namespace(model="vit_tiny_patch16_224", img_size=64, num_classes=1000,
                                         batch_size=32, workers=0)
    for steps, size in ((10, "2048"), (100, "3200")):
        cmd = bench_loop.outside_command("ours", steps, args, "out")
        assert cmd[cmd.index("--synthetic-size") + 1] == size
    assert bench_loop.synthetic_size(32, 100) == 3200  # the plain loop's set, the same size
