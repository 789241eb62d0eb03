"""common/fileio.py in-process: the output, path and write guards every command relies on.

Written to kill the mutants that survived a mutation run of the module (docs/measurements.md, "Scores"):
the CLI tests exercise these guards in subprocesses, where mutmut cannot see them. Each test checks
what a user relies on: an existing result is never replaced, a path read from a file never leaves
its folder, a full disk names the free space of the device the file was to go on.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_train.common import fileio, writer
from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.fileio import confined, is_s3, new_output, short, write_failed, write_json_atomic
from tests.fullfs import mounted_tmpfs

# ----- new_output: a result is never replaced ------------------------------------------------------


def test_an_existing_output_is_refused_unless_replacing_is_asked_for(tmp_path):
    out = tmp_path / "result.json"
    out.write_text("someone's record")
    with pytest.raises(UsageError, match=r"^--output: .*result.json already exists: remove it or choose another"):
        new_output(out, "--output")  # by default: refused
    assert new_output(out, "--output", replace=True).path == out
    assert out.read_text() == "someone's record"


def test_a_dangling_link_counts_as_an_existing_output(tmp_path):
    """Writing through a link to a missing file would create a file elsewhere: refused like a file."""
    out = tmp_path / "result.json"
    out.symlink_to(tmp_path / "elsewhere" / "target.json")
    with pytest.raises(UsageError, match="is a symbolic link: only a regular file is ever replaced"):
        new_output(out, "--output")


def test_a_directory_is_never_an_output_even_with_replace(tmp_path):
    with pytest.raises(UsageError, match=r"^--output: .* is a directory: give a file name"):
        new_output(tmp_path, "--output", replace=True)


def test_a_missing_folder_is_refused_unless_the_command_creates_it(tmp_path):
    out = tmp_path / "a" / "b" / "result.json"
    with pytest.raises(UsageError, match=r"^--output: folder .*b does not exist: create it first"):
        new_output(out, "--output")  # by default: refused
    assert new_output(out, "--output", create_folder=True).path == out  # two levels missing: both creatable
    assert not (tmp_path / "a").exists()  # checked only: the caller creates it


def test_a_folder_that_cannot_be_created_under_a_file_is_refused(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UsageError, match=r"^--output: .*a-file is not a folder: choose another location"):
        new_output(tmp_path / "a-file" / "sub" / "result.json", "--output", create_folder=True)


def test_a_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    """A read-only mount (as root, who may write anywhere else) or a folder without write permission."""
    folder = tmp_path / "ro"
    if os.geteuid() == 0:
        with mounted_tmpfs(folder, read_only=True):
            with pytest.raises(UsageError, match=r"^--output: folder .*ro is not writable: choose another location"):
                new_output(folder / "result.json", "--output")
        return
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(UsageError, match=r"^--output: folder .*ro is not writable: choose another location"):
            new_output(folder / "result.json", "--output")
    finally:
        folder.chmod(0o700)


# ----- S3 locations (the compile cache's door refusing them: tests/precompile/test_cache_door.py) ----------


def test_a_path_under_the_current_folder_is_shown_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert short(f"{tmp_path}/train.py:47") == "train.py:47"
    assert short(f"{tmp_path}x/train.py:47") == f"{tmp_path}x/train.py:47"  # a sibling folder sharing the prefix
    assert short("/elsewhere/train.py:47") == "/elsewhere/train.py:47" and short("") == ""


def test_only_the_s3_scheme_makes_an_s3_location():
    assert is_s3("s3://bucket/key") and not is_s3("bucket/key") and not is_s3("local/s3://b")


# ----- confined: a path read from a file never leaves its folder ---------------------------------------


@pytest.mark.parametrize("relative", [None, 5, "", "a\x00b"])
def test_what_is_not_a_relative_path_is_one_line(tmp_path, relative):
    with pytest.raises(UsageError, match=r"^files\[0\]: .* is not a relative path$"):
        confined(tmp_path, relative, "files[0]")


@pytest.mark.parametrize("relative", ["/etc/passwd", "../x", "a/../../x", "link/x"])
def test_a_path_outside_its_folder_is_refused(tmp_path, relative):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path)  # a link inside that leads out
    with pytest.raises(UsageError, match=r"points outside .*root: refusing it$"):
        confined(tmp_path / "root", relative, "files[0]")


def test_a_path_inside_its_folder_is_returned_resolved(tmp_path):
    assert confined(tmp_path, "a/../b/c", "x") == tmp_path.resolve() / "b" / "c"
    assert confined(tmp_path, ".", "x") == tmp_path.resolve()


# ----- write_failed: the one line of a failed write -----------------------------------------------------


def test_a_full_disk_names_the_free_space_of_the_folder_that_exists(tmp_path, monkeypatch):
    """The file's folder may not exist yet: the free space is that of its nearest existing folder
    (the device the file was to go on), not of the file system root."""
    asked = []
    real = fileio.shutil.disk_usage
    monkeypatch.setattr(fileio.shutil, "disk_usage", lambda p: asked.append(Path(p)) or real(p))
    err = write_failed(tmp_path / "new" / "deeper" / "out.json", OSError(errno.ENOSPC, "No space left"),
                       kept=", the previous one is kept")
    assert asked == [tmp_path]
    assert isinstance(err, RunError)
    free = float(str(err).split(" (")[1].split(" MiB")[0])
    assert abs(free - real(tmp_path).free / 2**20) < 64  # in MiB, as said
    assert str(err).startswith(f"no space left on the device of {tmp_path / 'new' / 'deeper' / 'out.json'} (")
    assert str(err).endswith("MiB free): it was not written, the previous one is kept; free some space and run again")


def test_another_write_error_names_the_file_and_the_reason_only(tmp_path):
    err = write_failed(tmp_path / "out.json", OSError(errno.EACCES, "Permission denied"))
    assert str(err) == f"cannot write {tmp_path / 'out.json'}: Permission denied"


def test_json_results_holding_paths_are_written_as_text(tmp_path):
    """Records carry Paths (run folders, caches): they are written as strings, never a crash after the run."""
    write_json_atomic(tmp_path / "r.json", {"cache": tmp_path / "cache", "n": 1})
    assert json.loads((tmp_path / "r.json").read_text()) == {"cache": str(tmp_path / "cache"), "n": 1}


# ----- work paths: a dead writer's leftover is cleaned, a live writer's never ----------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=60)
    return proc.pid


def test_only_the_leftovers_of_dead_processes_are_stale_and_no_process_is_signalled(tmp_path):
    final = tmp_path / "cache.tar.gz"
    live = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
                             "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert live.stdout.readline() == "ready\n"  # another writer, still at work (that a stray SIGHUP would stop)
    try:
        host = socket.gethostname()
        mine, dead = fileio.work_path(final, "part"), tmp_path / f".cache.tar.gz.part-{host}-{_dead_pid()}"
        other = tmp_path / f".cache.tar.gz.part-{host}-{live.pid}"
        for p in (mine, dead, other, tmp_path / f".cache.tar.gz.part-otherhost-{_dead_pid()}"):
            p.write_bytes(b"partial")
        assert mine.name == f".cache.tar.gz.part-{host}-{os.getpid()}"
        assert fileio.stale_work_paths(final, "part") == [dead]
        with pytest.raises(subprocess.TimeoutExpired):
            live.wait(timeout=0.5)  # checking that it lives did not stop it
    finally:
        live.kill()
        live.wait(timeout=60)


def test_a_process_of_another_user_counts_as_alive(tmp_path, monkeypatch):
    """kill(pid, 0) on another user's process raises PermissionError: it lives, its files stay."""
    def not_yours(pid, sig):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    final = tmp_path / "out"
    (tmp_path / f".out.building-{socket.gethostname()}-{_dead_pid()}").mkdir()
    monkeypatch.setattr(fileio.os, "kill", not_yours)
    assert fileio.stale_work_paths(final, "building") == []


def test_a_text_input_that_is_not_utf8_is_one_line_naming_the_byte_and_the_fix(tmp_path):
    try:
        b"ok \xff".decode("utf-8")
    except UnicodeDecodeError as exc:
        err = fileio.not_utf8(tmp_path / "cfg.yaml", exc)
    assert str(err) == f"{tmp_path / 'cfg.yaml'}: not UTF-8 text (byte 0xff at offset 3): save it as UTF-8"


# ----- a path no command can use: one line naming the option ------------------------------------------------


def test_an_unusable_path_is_one_line_naming_the_option_and_the_fix():
    loop = OSError(errno.ELOOP, "Too many levels of symbolic links", "/data/loop")
    assert str(fileio.unusable_path(loop, "--output")) == (
        "--output: path '/data/loop' goes through a loop of symbolic links: fix the link or give another path")
    assert str(fileio.unusable_path(loop)) == (
        "path '/data/loop' goes through a loop of symbolic links: fix the link or give another path")
    assert str(fileio.unusable_path(OSError(errno.ENAMETOOLONG, "File name too long", b"/x/" + b"a" * 300))) == (
        "path '/x/" + "a" * 56 + "... (303 characters) is too long (at most "
        "4095 bytes, and 255 for each name in it): give a shorter path")
    # Path.resolve() before Python 3.13 says a loop with a RuntimeError of its own
    assert str(fileio.unusable_path(RuntimeError("Symlink loop from '/data/X'"), "--cache")) == (
        "--cache: path '/data/X' goes through a loop of symbolic links: fix the link or give another path")


@pytest.mark.parametrize("exc", [
    OSError(errno.ELOOP, "Too many levels of symbolic links"),          # no file named: nothing to say about it
    OSError(errno.ENOENT, "No such file or directory", "/data/x"),      # the command's own business
    RuntimeError("maximum recursion depth exceeded"),
    NotImplementedError("Symlink loop from '/data/a'"),                 # only pathlib's own RuntimeError
    ValueError("Symlink loop from '/data/a'"),
])
def test_other_errors_are_not_an_unusable_path(exc):
    assert fileio.unusable_path(exc, "--output") is None


def test_an_unusable_path_is_refused_before_any_work_and_a_new_one_is_fine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short paths: the line shows them whole
    Path("a").symlink_to("b")
    Path("b").symlink_to("a")
    with pytest.raises(UsageError, match=r"^--out: path 'a/x' goes through a loop of symbolic links: fix the link"):
        fileio.refuse_unusable("a/x", "--out")
    Path("file").write_text("x")
    with pytest.raises(UsageError, match=r"^--out: path 'file/x' goes through a file as if it were a folder: check"):
        fileio.refuse_unusable("file/x", "--out")
    fileio.refuse_unusable("file/x", "--out", but=errno.ENOTDIR)  # the caller says it itself
    fileio.refuse_unusable("new/x", "--out")  # does not exist yet: fine
    with pytest.raises(UsageError, match=r"^--output: path 'a/r.json' goes through a loop of symbolic links"):
        new_output("a/r.json", "--output")

    def not_permitted(path, *args, **kwargs):  # e.g. a FUSE mount or a sandbox refusing the look itself
        raise PermissionError(errno.EPERM, "Operation not permitted", os.fspath(path))

    monkeypatch.setattr(fileio.os, "stat", not_permitted)
    with pytest.raises(UsageError, match=r"^--out: path 'x' cannot be used: operation not permitted: choose another"):
        fileio.refuse_unusable("x", "--out")


# ----- writing whole or not at all ----------------------------------------------------------------------------


def test_an_atomic_write_leaves_only_a_temporary_file_the_runs_cleanup_removes(tmp_path, monkeypatch):
    """While the file is written it is a hidden `.NAME.XXXX.tmp` beside it: what a killed write leaves
    behind, which the next run's clean-up (training/checkpoint.remove_stale_temps) deletes."""
    from neuron_train.training.checkpoint import remove_stale_temps

    seen = []
    real = writer.os.link
    monkeypatch.setattr(writer.os, "link", lambda src, dst, **kw: (seen.append(Path(src)), real(src, dst, **kw)))
    fileio.write_text_atomic(tmp_path / "metrics.jsonl", "{}\n")
    (temp,) = seen
    assert temp.parent == tmp_path  # beside the file: the rename is atomic on one file system
    leftover = temp.name
    (tmp_path / leftover).write_text("partial")  # as a write killed before its rename leaves it
    assert [p.name for p in remove_stale_temps(tmp_path)] == [leftover]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_folder_is_published_whole_into_new_folders_and_replaces_the_old_one(tmp_path):
    out = tmp_path / "new" / "deeper" / "report"
    fileio.publish_folder(out, {"a.html": b"1", "b.csv": b"2"})
    fileio.publish_folder(out, {"a.html": b"3"})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {"a.html": b"3", fileio.LISTED: b"a.html\n"}
    assert sorted(p.name for p in out.parent.iterdir()) == ["report"]  # no work folder left


def test_a_failed_swap_puts_the_old_folder_back_and_says_so(tmp_path, monkeypatch):
    out = tmp_path / "report"
    fileio.publish_folder(out, {"a.html": b"old"})
    real = fileio.os.rename

    def failing(src, dst):  # the new folder cannot take the name (a full disk, a folder gone read-only)
        if Path(src).name.startswith(".report.building-"):
            raise OSError(errno.EIO, "Input/output error", str(src))
        return real(src, dst)

    monkeypatch.setattr(fileio.os, "rename", failing)
    renames = []
    monkeypatch.setattr(fileio.os, "rename",
                        lambda src, dst: (renames.append((Path(src), Path(dst))), failing(src, dst)))
    with pytest.raises(RunError, match=rf"^cannot write {out}: Input/output error \(the previous folder, if any, is "
                                       r"kept as it was\)$"):
        fileio.publish_folder(out, {"a.html": b"new"})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {"a.html": b"old", fileio.LISTED: b"a.html\n"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]
    # the old folder was moved aside under the name recover_folder looks for after a killed process
    assert renames[0] == (out, fileio.work_path(out, "old")) and renames[-1] == (fileio.work_path(out, "old"), out)


def test_a_killed_publish_is_finished_the_old_folder_back_or_the_new_one_kept(tmp_path):
    host, dead = socket.gethostname(), _dead_pid()
    out = tmp_path / "report"
    old, building = tmp_path / f".report.old-{host}-{dead}", tmp_path / f".report.building-{host}-{dead}"
    old.mkdir()
    (old / "a.html").write_text("old")
    building.mkdir()
    fileio.recover_folder(out)  # killed after moving the old folder aside, before the new one took the name
    assert (out / "a.html").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["report"]
    old.mkdir()
    fileio.recover_folder(out)  # killed after the swap, before the old folder was deleted
    assert (out / "a.html").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["report"]
    out.rename(tmp_path / "moved")
    (tmp_path / "moved").rename(old)
    out.symlink_to(tmp_path / "elsewhere")  # the name is taken, even by a dangling link: the link stays
    (old / "notes.txt").write_text("not ours")
    fileio.recover_folder(out)  # the old folder lists no file: nothing in it is deleted
    assert out.is_symlink() and sorted(p.name for p in old.iterdir()) == ["a.html", "notes.txt"]
    (old / fileio.LISTED).write_text("a.html\n")  # what publish_folder writes into every folder it makes
    fileio.recover_folder(out)  # only the listed names go: the folder stays with what is not ours
    assert sorted(p.name for p in old.iterdir()) == ["notes.txt"]
    (old / "notes.txt").unlink()
    (old / "a.html").write_text("old")
    fileio.recover_folder(out, known=("a.html",))  # a folder made before lists: the names the caller knows

    assert out.is_symlink() and not old.exists()


def test_a_files_digest_is_its_sha256_over_every_block(tmp_path):
    data = os.urandom(3 * (1 << 20) + 5)  # more than one read block, and a short last one
    (tmp_path / "f").write_bytes(data)
    assert fileio.sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert fileio.sha256_file(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_removing_a_link_to_a_folder_removes_the_link_only_and_a_missing_path_is_nothing(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "keep").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    fileio.remove_path(tmp_path / "link")
    assert not (tmp_path / "link").is_symlink() and (tmp_path / "target" / "keep").read_text() == "x"
    fileio.remove_path(tmp_path / "gone")  # already removed (by a concurrent clean-up): fine
    fileio.remove_path(tmp_path / "target")
    assert list(tmp_path.iterdir()) == []


def test_a_quota_exceeded_is_a_full_disk_in_every_writer(tmp_path):
    """Mutant: EDQUOT (a user's disk quota) not treated as a full disk (common/fileio.py,
    training/checkpoint.py; precompile/archive.py: the next test)."""
    from neuron_train.common.fileio import write_failed
    from neuron_train.training.checkpoint import write_failed_in_run

    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    (tmp_path / "checkpoints").mkdir()
    assert str(write_failed(tmp_path / "f.json", quota)).startswith("no space left on the device of")
    line = str(write_failed_in_run(tmp_path, tmp_path / "checkpoints" / "step-00000001.pt", quota))
    assert line.startswith(f"no space left on {tmp_path / 'checkpoints'}") and "--resume" in line
