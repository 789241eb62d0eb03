"""Running a user's command (or our own run.py) as a child that never outlives us.

- The command runs in its own session (process group): whatever it starts can be ended together.
- A watchdog process (_watchdog.py) holds a pipe to us: if we die, even by SIGKILL, it ends the
  command's process group (SIGTERM, then SIGKILL after a grace period).
- SIGTERM/SIGINT to us are passed on to the command's group (a second one kills it), and the
  caller still gets the output so far: a partial report, not none.
- The output is read until the command itself exits; a child of it that keeps the pipe open
  (a server, a stray worker) does not hold us: the rest of the group is then ended.
- How it ended is kept: an exit code, or the signal that killed it.
- A daemon the command starts in a session of its own (`setsid`) is not in its group: while the
  command runs we are a child subreaper (prctl), so such orphans become our children instead of
  init's, and every descendant left at the end is ended too (`_end_descendants`), listed again on
  every pass until none is left (a daemon that re-forks has a new pid each time). If we are killed
  with SIGKILL, the watchdog ends the group only (a daemon in its own session then survives).
- The output is read in time linear in its size: each line keeps its last LINE_BYTES (a progress
  bar that writes only `\r` is one endless line).
"""

from __future__ import annotations

import collections
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, TextIO

_WATCHDOG = Path(__file__).resolve().with_name("_watchdog.py")
GRACE_S = 10.0      # after SIGTERM, before SIGKILL (the group's processes write their records)
DRAIN_S = 1.0       # output still read after the command exited (a grandchild may hold the pipe)
POLL_S = 0.1
KILL_S = 30.0       # SIGKILL repeated this long at most (a process in uninterruptible sleep outlasts it)
LINE_BYTES = 8192   # of an output line, the last bytes kept


@dataclass
class Ended:
    """How a command run ended."""

    code: int                      # its exit status; 128 + N when signal N killed it (as a shell says)
    signal: int | None = None      # the signal that killed it, if one did
    interrupted: int | None = None  # the signal (SIGTERM/SIGINT) that made us end it early
    tail: list[str] = field(default_factory=list)   # its last output lines

    def how(self) -> str:
        """'exited with code N' or 'was killed by SIGKILL'."""
        return f"was {self.status()}" if self.signal is not None else f"exited with code {self.code}"

    def status(self) -> str:
        """'exit code N' or 'killed by SIGKILL'."""
        return f"killed by {signal.Signals(self.signal).name}" if self.signal is not None else f"exit code {self.code}"


def run(command: list[str], env: dict[str, str], *, stdout_too: bool, tail_lines: int,
        echo: bool = True) -> Ended:
    """Run `command`, echoing its stderr (and stdout when `stdout_too`, merged into ours) as it comes.
    OSError: it could not start."""
    before = set(descendants(os.getpid()))
    reaper = _subreaper(True)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE if stdout_too else None,
                            stderr=subprocess.STDOUT if stdout_too else subprocess.PIPE, start_new_session=True)
    watchdog = subprocess.Popen([sys.executable, str(_WATCHDOG), str(proc.pid), str(GRACE_S)],
                                stdin=subprocess.PIPE, start_new_session=True)
    pipe = proc.stdout if stdout_too else proc.stderr
    assert pipe is not None  # the one Popen was given PIPE for
    child = _Child(proc, pipe, tail_lines)
    previous = child.forward_signals()
    try:
        child.read((sys.stdout if stdout_too else sys.stderr) if echo else None)
    finally:
        _restore(previous)
        proc.poll()  # reaped first: a zombie leader would keep its group "alive"
        end_group(proc.pid)
        child.pipe.close()
        assert watchdog.stdin is not None
        watchdog.stdin.close()  # the watchdog finds the group gone and exits
        if reaper:
            _end_descendants(exclude=before | {watchdog.pid, proc.pid})
            _subreaper(False)
    code = proc.wait()
    killed = -code if code < 0 else None
    return Ended(128 + killed if killed else code, killed, child.got[0] if child.got else None, list(child.tail))


class _Child:
    def __init__(self, proc: subprocess.Popen[bytes], pipe: IO[bytes], tail_lines: int) -> None:
        self.proc, self.pipe = proc, pipe
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.got: list[int] = []          # signals we received
        self.signalled_at = 0.0

    def read(self, out: TextIO | None) -> None:
        """Echo and keep the output until the command has exited (then at most DRAIN_S more)."""
        fd, partial, ended_at, killed = self.pipe.fileno(), b"", None, False
        while True:
            now = time.monotonic()
            if ended_at is None and self.proc.poll() is not None:
                ended_at = now
            if ended_at is not None and now - ended_at > DRAIN_S:
                break
            if self.got and not killed and now - self.signalled_at > GRACE_S:
                killed = True
                _kill(self.proc.pid, signal.SIGKILL)  # it did not end after the signal we passed on
            ready, _, _ = select.select([fd], [], [], POLL_S)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                if ended_at is None:  # the pipe closed first: wait for the exit itself
                    self.proc.wait()
                break
            if out is not None:
                out.buffer.write(chunk)
                out.buffer.flush()
            # each line keeps its last LINE_BYTES only, an unfinished one too (a progress bar that
            # writes only \r makes one line of the whole output): linear time, bounded memory
            lines = chunk.split(b"\n")
            lines[0] = partial + lines[0]
            partial = lines.pop()[-LINE_BYTES:]
            self.tail.extend(_text(line) for line in lines[-(self.tail.maxlen or len(lines)):])
        if partial:
            self.tail.append(_text(partial))

    def forward_signals(self) -> dict:
        """SIGTERM/SIGINT to us end the command's group too; a second one kills it outright."""
        def handler(signum: int, frame: FrameType | None) -> None:
            if not self.got:
                self.signalled_at = time.monotonic()
            self.got.append(signum)
            _kill(self.proc.pid, signum if len(self.got) == 1 else signal.SIGKILL)

        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: signals stay as they were
                pass
        return previous


def _text(line: bytes) -> str:
    return line[-LINE_BYTES:].decode("utf-8", "replace").rstrip()


def _restore(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _kill(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def end_group(pgid: int, grace_s: float | None = None) -> None:
    """End what is left of the command's process group: SIGTERM, then SIGKILL after `grace_s`
    (GRACE_S by default), repeated until no process of the group runs (one forked meanwhile too)."""
    _kill(pgid, signal.SIGTERM)
    deadline = time.monotonic() + (GRACE_S if grace_s is None else grace_s)
    while _group_runs(pgid) and time.monotonic() < deadline + KILL_S:
        if time.monotonic() > deadline:
            _kill(pgid, signal.SIGKILL)
        time.sleep(0.05)


def _group_runs(pgid: int) -> bool:
    """A process of group `pgid` still runs. Zombies do not count: a worker the command left (a
    process pool's, pytorch/xla's test_train_mp_mnist.py) is ours once the command exits (we are its
    subreaper) and, ended, stays in the group as a zombie until reaped; counted, it held every such
    run for the whole grace period. Our zombies other than the leader (the caller's Popen reaps it)
    are reaped here."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    for pid, state, parent, group in _processes():
        if group != pgid:
            continue
        if state != b"Z":
            return True
        if parent == os.getpid() and pid != pgid:
            _reaped(pid)
    return False


_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _subreaper(on: bool) -> bool:
    """Make orphaned descendants ours (not init's) while a command runs; False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _processes() -> Iterator[tuple[int, bytes, int, int]]:
    """(pid, state, parent pid, process group) of every process, from /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state, parent, group = fh.read().rsplit(b")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        yield int(entry), state, int(parent), int(group)


def descendants(root: int, parents: dict[int, int] | None = None) -> list[int]:
    """Every process below `root`, parents before their children. `parents`: pid -> parent pid;
    by default the live processes (zombies left out), from /proc."""
    if parents is None:
        parents = {pid: parent for pid, state, parent, _ in _processes() if state != b"Z"}
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.append(pid)
            todo.append(pid)
    return found


def _end_descendants(exclude: set[int], grace_s: float | None = None) -> None:
    """SIGTERM, then SIGKILL after the grace period, to every descendant of ours the command left
    (a `setsid` daemon reparented to us), each reaped. Repeated until one reading of /proc finds
    neither a live descendant nor a zombie child of ours: a daemon that re-forks (a new pid each
    time, ours once its parent exits) is found again, also one forked after /proc was listed (its
    parent is then seen running, or as our zombie). `exclude`: processes that are not the command's."""
    deadline = time.monotonic() + (GRACE_S if grace_s is None else grace_s)
    termed: set[int] = set()
    me = os.getpid()
    while time.monotonic() < deadline + KILL_S:
        seen = [(pid, state, parent) for pid, state, parent, _ in _processes() if pid not in exclude]
        zombies = [pid for pid, state, parent in seen if state == b"Z" and parent == me]
        dead = {pid for pid, state, _ in seen if state == b"Z"}
        left = [p for p in descendants(me, {pid: parent for pid, _, parent in seen}) if p not in dead]
        if not left and not zombies:
            return
        late = time.monotonic() > deadline
        for pid in left:
            if late or pid not in termed:
                termed.add(pid)
                try:
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for pid in zombies:
            _reaped(pid)
        time.sleep(POLL_S / 2)


def _reaped(pid: int) -> bool:
    """True once `pid` is gone (reaped here when it is our child)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:  # not our child: gone when signal 0 finds nothing
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
