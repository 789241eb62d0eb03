"""A command's whole life under check-graphs, precompile and bench (instrument/proc.py), with real
processes and real signals: the child's own error under torchrun, a partial report on
SIGTERM/SIGINT with the command's process group ended, nothing left running after kill -9 of
precompile or bench, no hang on a pipe a grandchild holds, and a process that never wrote its
record (os._exit, SIGKILL) named as such.
"""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuron_train.instrument import proc
from neuron_train.instrument.runner import command_error
from tests.conftest import ROOT, cpu_env

LIFECYCLE = ROOT / "tests" / "fixtures" / "instrument" / "lifecycle.py"
NT = [sys.executable, "-m", "neuron_train"]


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def wait_for(predicate, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def start(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([*NT, *args], env=cpu_env(), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def pids_when_ready(pids_file: Path, proc: subprocess.Popen) -> list[int]:
    assert wait_for(lambda: pids_file.exists() or proc.poll() is not None), "the command never got ready"
    assert pids_file.exists(), proc.communicate()[0]
    return [int(p) for p in pids_file.read_text().split()]


def test_a_launchers_banner_is_not_the_error():
    """torchrun's ChildFailedError traceback comes after the child's own: the child's is the error."""
    tail = ["Traceback (most recent call last):", '  File "t.py", line 3, in <module>',
            "[rank1]: NameError: name 'undefined_name' is not defined",
            "Traceback (most recent call last):", '  File "/venv/bin/torchrun", line 8, in <module>',
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
            "============================================================", "t.py FAILED",
            "  exitcode  : 1 (pid: 123)", "============================================================"]
    assert command_error(tail) == "NameError: name 'undefined_name' is not defined"
    assert command_error(["some output", "ValueError: bad", ""]) == "ValueError: bad"


def test_a_group_of_zombies_has_ended_and_a_group_with_a_live_process_runs():
    """A zombie the command left is ours to reap, later: it must not count as a running process of the
    command's group (it held check-graphs 10 s after pytorch/xla's test_train_mp_mnist.py)."""
    dead = subprocess.Popen(["true"], start_new_session=True)
    live = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert wait_for(lambda: not alive(dead.pid), timeout=30)  # a zombie now: we have not reaped it
        assert Path(f"/proc/{dead.pid}").exists()
        assert not proc._group_runs(dead.pid)
        assert proc._group_runs(live.pid)
    finally:
        live.kill()
        live.wait()
        dead.wait()


@pytest.mark.slow
def test_under_torchrun_the_childs_own_error_is_reported(tmp_path):
    report = tmp_path / "r.json"
    proc = subprocess.run([*NT, "check-graphs", "--json", str(report), "--", sys.executable, "-m",
                           "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(LIFECYCLE),
                           "name", str(tmp_path / "pids")],
                          env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr
    failure = [p for p in json.loads(report.read_text())["problems"] if p.startswith("the command exited")]
    assert failure == ["the command exited with code 1: NameError: name 'undefined_name' is not defined"]
    # precompile says the same in its one line
    proc = subprocess.run([*NT, "precompile", "--compile-cache", str(tmp_path / "cc"), "--", sys.executable, "-m",
                           "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(LIFECYCLE),
                           "name", str(tmp_path / "pids")],
                          env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    assert "NameError: name 'undefined_name' is not defined" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_check_graphs_leaves_a_partial_report_and_ends_the_group(tmp_path, sig):
    report, pids_file = tmp_path / "r.json", tmp_path / "pids"
    proc = start(tmp_path, "check-graphs", "--json", str(report), "--", sys.executable, str(LIFECYCLE), "hang",
                 str(pids_file))
    script, grandchild = pids_when_ready(pids_file, proc)
    proc.send_signal(sig)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, output
    r = json.loads(report.read_text())
    assert f"interrupted by {sig.name}: the command was ended; this report covers what ran until then" \
        in r["problems"], output
    assert r["steps"] == 1 and r["processes"], output  # the script's record, written as it ended
    assert r["interrupted_by"] == sig.name
    assert not alive(script) and not alive(grandchild)


@pytest.mark.slow
@pytest.mark.parametrize("command", [["precompile", "--compile-cache", "cc"],
                                     ["bench", "--output", "b.json", "--steps", "5"]], ids=["precompile", "bench"])
def test_kill_9_of_precompile_or_bench_leaves_nothing_running(tmp_path, command):
    pids_file = tmp_path / "pids"
    proc = start(tmp_path, *command, "--", sys.executable, str(LIFECYCLE), "hang", str(pids_file))
    script, grandchild = pids_when_ready(pids_file, proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert wait_for(lambda: not alive(script) and not alive(grandchild), timeout=30), \
        f"left running: {[p for p in (script, grandchild) if alive(p)]}"


@pytest.mark.slow
def test_a_grandchild_holding_stderr_does_not_hold_check_graphs(tmp_path):
    pids_file = tmp_path / "pids"
    began = time.monotonic()
    proc = subprocess.run([*NT, "check-graphs", "--", sys.executable, str(LIFECYCLE), "leave", str(pids_file)],
                          env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - began < 300
    _, grandchild = (int(p) for p in pids_file.read_text().split())
    assert not alive(grandchild)


@pytest.mark.slow
@pytest.mark.parametrize("mode, words", [
    ("os_exit", "imported torch_xla but ended without writing its record"),
    ("sigkill", "the command was killed by SIGKILL"),
], ids=["os_exit", "sigkill"])
def test_a_process_that_never_wrote_its_record_is_named(tmp_path, mode, words):
    report = tmp_path / "r.json"
    proc = subprocess.run([*NT, "check-graphs", "--json", str(report), "--", sys.executable, str(LIFECYCLE), mode,
                           str(tmp_path / "pids")], env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    problems = json.loads(report.read_text())["problems"]
    assert any(words in p for p in problems), problems
    assert not any("no process of the command imported torch_xla" in p for p in problems), problems
    assert any("imported torch_xla but ended without writing its record" in p for p in problems), problems


@pytest.mark.slow
def test_the_start_up_hook_loads_the_checker_only_when_torch_xla_is_imported(tmp_path, monkeypatch):
    """Lazy arming (the start-up cost of every process a command starts): a process that never imports
    torch_xla loads no module of the checker or the probe; importing torch_xla arms it all."""
    from neuron_train.instrument.marker import started
    from neuron_train.instrument.runner import instrumented_env

    for key, value in cpu_env().items():
        monkeypatch.setenv(key, value)
    env = instrumented_env(tmp_path, 0)
    loaded = "import sys; print(sorted(m for m in sys.modules if m.startswith('neuron_train')))"
    plain = subprocess.run([sys.executable, "-c", loaded], env=env, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0, plain.stderr
    assert not [m for m in ast.literal_eval(plain.stdout)
                if m.startswith(("neuron_train.graphs", "neuron_train.instrument.probe"))]
    assert "neuron_train.instrument.start" in plain.stdout and not started(tmp_path)  # armed, not loaded
    armed = subprocess.run([sys.executable, "-c", f"import torch_xla; {loaded}"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert armed.returncode == 0, armed.stderr
    assert {"neuron_train.graphs.recorder", "neuron_train.instrument.probe"} <= set(ast.literal_eval(armed.stdout))
    assert [s.pid for s in started(tmp_path)]  # the process marked itself as checked
