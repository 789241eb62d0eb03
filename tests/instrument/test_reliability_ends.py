"""Issue 42 (reliability round 5), row 2: every process we start ends, also a daemon that calls
`setsid`, ignores SIGTERM and re-forks every 50 ms (a new pid each time); and a command's output is
read in time linear in its size with bounded memory. Plain Python children (no torch): fast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from neuron_train.instrument import proc

HOPPER = """
import os, pathlib, signal, sys, time
if os.fork() == 0:
    os.setsid()                                  # a session of its own: not in the command's group
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() != 0:                           # a double fork: the daemon is adopted
        os._exit(0)
    while True:
        pathlib.Path(sys.argv[1] + ".new").write_text(str(os.getsid(0)))
        os.replace(sys.argv[1] + ".new", sys.argv[1])  # never seen half-written
        time.sleep(0.05)
        if sys.argv[2] == "hop" and os.fork() != 0:  # a new pid every 50 ms; the old one exits
            os._exit(0)
os.wait()
time.sleep(0.3)
"""


def session_members(sid: int) -> list[int]:
    """The running processes of session `sid` (zombies are ended)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            fields = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != b"Z":
            found.append(int(entry))
    return found


def end_session(sid: int) -> None:
    for _ in range(500):
        left = session_members(sid)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


@pytest.mark.parametrize("moves", ["hop", "stay"])
def test_a_daemon_that_setsids_ignores_sigterm_and_reforks_does_not_outlive_the_command(tmp_path, monkeypatch, moves):
    """Mutants: the descendants listed once (the daemon's next pid was never seen, and it kept running
    after check-graphs and plan ended); SIGKILL sent only to pids not seen before (one that stays)."""
    monkeypatch.setattr(proc, "GRACE_S", 0.5)
    sid_file = tmp_path / "sid"
    ended = proc.run([sys.executable, "-c", HOPPER, str(sid_file), moves], dict(os.environ), stdout_too=False,
                     tail_lines=5, echo=False)
    sid = int(sid_file.read_text())
    try:
        assert ended.code == 0
        time.sleep(0.3)  # a survivor would have hopped meanwhile
        assert session_members(sid) == [], "the re-forking daemon outlived the command"
    finally:
        end_session(sid)


STUBBORN_GROUP = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(os.getpid(), flush=True)
while True:
    time.sleep(0.05)
"""


def test_a_zombie_child_left_over_is_reaped():
    """A child of ours that has exited (an adopted orphan) is reaped, also when nothing else is left.
    Mutant: the loop ends as soon as no live descendant is seen (a zombie means one just exited, and
    a process it forked may be ours now)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        while Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":
            time.sleep(0.01)
        proc._end_descendants(exclude=set(proc.descendants(os.getpid())), grace_s=0.5)
        assert not Path(f"/proc/{pid}").exists(), "the zombie was not reaped"
    finally:
        if Path(f"/proc/{pid}").exists():
            os.waitpid(pid, 0)


def test_end_group_kills_a_group_that_ignores_sigterm():
    """Mutant: end_group never sends SIGKILL (a command ignoring SIGTERM ran on after the run)."""
    child = subprocess.Popen([sys.executable, "-c", STUBBORN_GROUP], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert child.stdout is not None
        child.stdout.readline()  # its SIGTERM handler is set
        proc.end_group(child.pid, grace_s=0.3)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def tail_of(script: str, lines: int) -> list[str]:
    return proc.run([sys.executable, "-c", script], dict(os.environ), stdout_too=True, tail_lines=lines,
                    echo=False).tail


def test_an_endless_line_keeps_its_end_only():
    """64 MB without a newline (a progress bar writing only \\r) took 79 s: the unfinished line was
    joined to each new chunk again. Now an unfinished line keeps its last LINE_BYTES. Mutant: the
    line kept whole (memory and time grow with it)."""
    tail = tail_of("import sys; sys.stdout.write('#\\r' * 2_000_000 + 'the end')", 3)
    assert tail[-1].endswith("the end")
    assert len(tail[-1]) <= proc.LINE_BYTES


def test_an_endless_line_is_read_in_bounded_memory():
    """Mutant: the unfinished line kept whole until its end (20 MB here; 64 MB took 79 s)."""
    tracemalloc.start()
    try:
        tail_of("import sys; sys.stdout.write('#' * 20_000_000)", 3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4_000_000, f"{peak:,} bytes at the peak"


@pytest.mark.parametrize("sizes", [[1, 70000, 3, 0, 5], [65536, 65535, 2], [10] * 20000])
def test_lines_split_across_reads_come_back_whole(sizes):
    """Lines that straddle the 64 KiB reads, and many short lines in one read, are kept exactly (the
    last `lines` of them). Sizes below LINE_BYTES stay whole; a longer one keeps its end."""
    script = f"import sys\nfor size in {sizes}: sys.stdout.write('ab' * (size // 2) + 'c' * (size % 2) + '\\n')"
    expected = [("ab" * (s // 2) + "c" * (s % 2))[-proc.LINE_BYTES:] for s in sizes][-4:]
    assert tail_of(script, 4) == expected
