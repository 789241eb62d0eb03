"""Issue 42 (reliability round 5), row 6 and item 7: guards that fresh mutants got past, and two
more one-line endings. A FIFO swapped in after the reader's first check, a file growing past its
bound while read, a read-only mount under `cache prune`, Ctrl-C while a command's module imports
torch, and the quiet torchrun rank's wait. In-process, or a plain Python child (no torch).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from neuron_train import cli
from neuron_train.common import reader
from neuron_train.common.errors import UsageError
from tests.conftest import ROOT
from tests.precompile.test_reliability_cache import make_cache
from tests.precompile.test_reliability_rules import age, compiled_entry


def test_a_fifo_swapped_in_after_the_first_check_is_refused(tmp_path, monkeypatch):
    """Mutant: no `fstat` check after the open (the FIFO, opened O_NONBLOCK with no writer, was read
    as an empty file: a run silently used its defaults)."""
    path = tmp_path / "c.yaml"
    path.write_text("train: {}\n")
    first_check = reader.regular_file

    def swapped_after(p: str | os.PathLike, flag: str = "") -> os.stat_result:
        st = first_check(p, flag)
        Path(p).unlink()
        os.mkfifo(p)  # between the check and the open, as another process could
        return st

    monkeypatch.setattr(reader, "regular_file", swapped_after)
    with pytest.raises(UsageError, match="is a FIFO"):
        reader.read_bytes(path, "--config")


def test_a_file_growing_past_its_bound_while_read_is_refused(tmp_path, monkeypatch):
    """Mutant: the bound checked only on the size at the open (the rest was cut off silently)."""
    path = tmp_path / "prices.json"
    path.write_bytes(b"x" * 100)
    real_fstat = os.fstat

    def grows(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        with open(path, "ab") as fh:  # a writer appends after the size was taken
            fh.write(b"y" * 5000)
        return st

    monkeypatch.setattr(reader.os, "fstat", grows)
    with pytest.raises(UsageError, match="grew past 1,000 bytes while read"):
        reader.read_bytes(path, "--prices", limit=1000)


def test_prune_on_a_read_only_mount_is_one_line(tmp_path, capsys, monkeypatch):
    """Bad row 6: EROFS (the lock file cannot be created) was a traceback. The kernel's error is
    raised for every write into the cache, as a read-only mount would."""
    cache = make_cache(tmp_path / "c", compiled_entry())
    age(cache)
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if str(path).startswith(str(cache)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    code = cli.main(["cache", "prune", "--compile-cache", str(cache), "--older-than", "1d"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "is on a read-only file system" in err, err


def test_ctrl_c_while_a_commands_module_is_imported_is_one_line(capsys, monkeypatch):
    """Bad row 6: Ctrl-C while `train` imported torch was a 30-line traceback (the module was
    imported outside the handler)."""
    def interrupted(name: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert cli.main(["train", "--max-steps", "1"]) == 130
    assert capsys.readouterr().err == "neuron-train train: interrupted\n"


QUIET_RANK = """
import os, sys
os.environ["TORCHELASTIC_RUN_ID"] = "test"
from neuron_train.commands import train
print("waiting", flush=True)
train._wait_to_be_stopped()
print("returned", flush=True)
"""


@pytest.mark.slow  # the child imports torch (commands/train.py does)
def test_a_quiet_torchrun_rank_waits_until_it_is_stopped():
    """Mutant: the fixed 3 s sleep put back (rank 0 could be stopped by torchrun before it printed
    the one line). The rank must still be waiting well after 3 s, and end on torchrun's SIGTERM."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", QUIET_RANK], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline() == "waiting\n"
        time.sleep(5)
        child.send_signal(signal.SIGTERM)
        rest = child.communicate(timeout=60)[0]
        assert "returned" not in rest, "the quiet rank stopped waiting on its own"
        assert child.returncode == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# ----------------------------------------------------------------------------- plan: weak rows


def test_instances_named_twice_in_any_case_are_one_and_a_list_of_none_is_refused(capsys):
    """Weak rows: `--instances trn1.2xlarge,TRN1.2xlarge` estimated twice; `--instances ,` ran with none."""
    from neuron_train.cost import plan_data

    assert plan_data.wanted_instances(" trn1.2xlarge,TRN1.2xlarge,inf2.xlarge ") == ["trn1.2xlarge", "inf2.xlarge"]
    assert plan_data.wanted_instances(None) is None
    for given in (",", "", " , "):
        code = cli.main(["plan", "--model", "vit-nano", "--instances", given])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "--instances: no instance type in" in err, err


WAITS = """
import pathlib, sys, time
pathlib.Path(sys.argv[1]).write_text("ready")
time.sleep(120)
"""


def test_ctrl_c_to_plan_is_interrupted_exit_130(tmp_path, capsys, monkeypatch):
    """Weak row: SIGINT to `plan -- COMMAND` said the command never imported torch_xla (exit 1)."""
    ready = tmp_path / "ready"

    def ctrl_c() -> None:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C; proc.run passes it on to the command

    threading.Thread(target=ctrl_c, daemon=True).start()
    code = cli.main(["plan", "--instances", "trn1.2xlarge", "--", sys.executable, "-c", WAITS, str(ready)])
    err = capsys.readouterr().err
    assert code == 130 and err.strip().splitlines()[-1] == "neuron-train plan: interrupted", err


def test_more_processes_than_an_instances_cores_are_said_to_be_capped():
    """Weak row: `--nproc-per-instance 64` was capped at each type's NeuronCores silently."""
    from neuron_train.cost import plan_data

    known = plan_data.targets()
    chosen = [known["trn1.2xlarge"], known["trn1.32xlarge"]]
    assert plan_data.capped_note(64, chosen) == ("plan: warning: --nproc-per-instance 64 is more than the NeuronCores "
                                             "of trn1.2xlarge (2), trn1.32xlarge (32): capped at each one's cores")
    assert plan_data.capped_note(2, chosen) is None and plan_data.capped_note(None, chosen) is None


# ----------------------------------------------------------------------------- cache: weak rows


def test_a_prune_that_failed_on_a_protected_file_is_not_later_reported_as_killed(tmp_path, capsys, monkeypatch):
    """Weak row: the prune's mark stayed after a deletion failed (EACCES on a protected file), and
    every later `verify` said a prune had been killed. Now the entries it did delete are forgotten
    and the mark goes; the failure is the one line now."""
    from neuron_train.common import writer

    cache = make_cache(tmp_path / "c", {"xla/1": b"a", "xla/2": b"b"})
    age(cache)
    real_remove = writer.remove_ours

    def protected(path: Path) -> bool:
        if Path(path).name == "2":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_remove(path)

    monkeypatch.setattr(writer, "remove_ours", protected)
    code = cli.main(["cache", "prune", "--compile-cache", str(cache), "--older-than", "1d"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "permission denied" in err, err
    assert not list(cache.glob(".prune.running-*"))
    assert cli.main(["cache", "verify", "--compile-cache", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "prune" not in out and "missing" not in out, out  # xla/1 is forgotten, xla/2 is whole


def test_an_unreadable_manifest_is_unreadable_not_damaged(tmp_path, capsys, monkeypatch):
    """Weak row: a manifest we may not read was called damaged, with advice (move it aside) that
    would lose it."""
    from neuron_train.precompile import store

    cache = make_cache(tmp_path / "c", {"xla/1": b"a"})
    manifest = str(cache / store.MANIFEST)
    real_open = os.open

    def forbidden(path, flags, *args, **kwargs):
        if str(path) == manifest:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", forbidden)
    code = cli.main(["cache", "verify", "--compile-cache", str(cache)])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and "cannot be read" in err, err
    assert "damaged" not in err and "move it aside" not in err
