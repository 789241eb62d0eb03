"""Issue 31 (reliability round 4): every process we start ends, also one that ignores SIGTERM.

The fixture commands here ignore SIGTERM and SIGINT (every earlier fixture died on SIGTERM, so
nothing exercised the escalation to SIGKILL). Real processes and real signals: `slow`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from neuron_train.instrument import proc

pytestmark = pytest.mark.slow

STUBBORN = """
import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
pathlib.Path(sys.argv[1]).write_text("ready")
time.sleep(120)
"""


def wait_for(path: Path, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_watchdog_kills_a_command_that_ignores_sigterm_after_the_grace_period(tmp_path):
    """Mutant: no SIGKILL after the grace period in _watchdog.py (a command that ignores SIGTERM ran
    for ever after neuron-train was killed)."""
    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", STUBBORN, str(ready)], start_new_session=True)
    try:
        wait_for(ready)
        dog = subprocess.Popen([sys.executable, str(proc._WATCHDOG), str(child.pid), "0.5"],
                               stdin=subprocess.PIPE, start_new_session=True)
        assert dog.stdin is not None
        dog.stdin.close()  # what the kernel does when neuron-train dies, kill -9 included
        assert child.wait(timeout=30) == -signal.SIGKILL
        assert dog.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_forwarded_ctrl_c_ends_a_command_that_ignores_it_after_the_grace_period(tmp_path, monkeypatch):
    """Mutant: no SIGKILL in proc.py after a forwarded Ctrl-C (the run waited for the command for ever)."""
    monkeypatch.setattr(proc, "GRACE_S", 1.0)
    ready = tmp_path / "ready"

    def ctrl_c() -> None:
        wait_for(ready)
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C; proc.run forwards it to the command

    threading.Thread(target=ctrl_c, daemon=True).start()
    started = time.monotonic()
    ended = proc.run([sys.executable, "-c", STUBBORN, str(ready)], dict(os.environ), stdout_too=False,
                     tail_lines=5, echo=False)
    assert ended.interrupted == signal.SIGINT and ended.signal == signal.SIGKILL
    assert time.monotonic() - started < 60  # the command would sleep 120 s


DAEMON = """
import os, pathlib, sys, time
if os.fork() == 0:
    os.setsid()                      # a session of its own: not in the command's process group
    if os.fork() == 0:
        pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))
        time.sleep(120)
    os._exit(0)
os.wait()
time.sleep(0.5)
"""


def gone(pid: int) -> bool:
    """Not running: absent, or a zombie nobody reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"Z"
    except FileNotFoundError:
        return True


def test_a_daemon_that_calls_setsid_does_not_outlive_the_command(tmp_path):
    """Weak row: a daemon in a session of its own outlived check-graphs (on a Neuron host it kept its
    NeuronCores). Every descendant is tracked, not only the process group."""
    pid_file = tmp_path / "daemon.pid"
    ended = proc.run([sys.executable, "-c", DAEMON, str(pid_file)], dict(os.environ), stdout_too=False,
                     tail_lines=5, echo=False)
    daemon = int(pid_file.read_text())
    try:
        assert ended.code == 0
        deadline = time.monotonic() + 10
        while not gone(daemon) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(daemon), "the daemon outlived the command"
    finally:
        if not gone(daemon):
            os.kill(daemon, signal.SIGKILL)


WORKER_LEFT = """
import pathlib, subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # in the command's group
pathlib.Path(sys.argv[1]).write_text(str(worker.pid))
"""


def test_a_worker_the_command_left_does_not_hold_the_run_for_the_grace_period(tmp_path):
    """The command exits and leaves a worker in its group; the SIGTERM to the group ends the worker,
    which becomes a zombie of ours (the subreaper's) until it is reaped. Mutants: zombies count as
    running in end_group (each such run waited GRACE_S, 10 s, after the command had finished); the
    worker is never reaped."""
    pid_file = tmp_path / "worker.pid"
    started = time.monotonic()
    ended = proc.run([sys.executable, "-c", WORKER_LEFT, str(pid_file)], dict(os.environ), stdout_too=False,
                     tail_lines=5, echo=False)
    assert ended.code == 0
    assert time.monotonic() - started < proc.GRACE_S / 2
    assert not Path(f"/proc/{pid_file.read_text()}").exists(), "the worker was never reaped"
