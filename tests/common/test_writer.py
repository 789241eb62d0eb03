"""The writer's rules (common/writer.py), over every kind of entry that can stand where we write:
nothing, a regular file, a link to a file, a dangling link, a folder holding a file, a FIFO.
Hypothesis picks the kind, the bytes and the order of events; each rule is checked for what it
promises: what is not ours is never changed, what is ours is whole."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_train.common import writer
from neuron_train.common.errors import RunError, UsageError
from tests.training.test_reliability_files import within

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = ["none", "file", "link", "dangling", "dir", "fifo"]
DATA = st.binary(max_size=300)


def make(folder: Path, name: str, kind: str) -> Path:
    """`name` in `folder` as an entry of `kind`; a link points at `folder/theirs` (the user's file)."""
    path, theirs = folder / name, folder / "theirs"
    theirs.write_bytes(b"the user's bytes")
    if kind == "file":
        path.write_bytes(b"an old result")
    elif kind == "link":
        path.symlink_to(theirs)
    elif kind == "dangling":
        path.symlink_to(folder / "missing")
    elif kind == "dir":
        path.mkdir()
        (path / "thesis.tex").write_bytes(b"chapter 1")
    elif kind == "fifo":
        os.mkfifo(path)
    return path


def state(folder: Path) -> dict[str, object]:
    """Everything in `folder`: a file's bytes, a link's target, a folder's files, a FIFO's kind."""
    out: dict[str, object] = {}
    for p in sorted(folder.rglob("*")):
        st_ = p.lstat()
        key = p.relative_to(folder).as_posix()
        out[key] = (os.readlink(p) if p.is_symlink() else p.read_bytes() if stat.S_ISREG(st_.st_mode)
                    else stat.S_IFMT(st_.st_mode))
    return out


@SETTINGS
@given(kind=st.sampled_from(KINDS), replace=st.booleans())
def test_an_output_is_accepted_only_when_absent_or_a_regular_file_to_replace(kind, replace):
    with tempfile.TemporaryDirectory() as tmp:
        path = make(Path(tmp), "out.json", kind)
        before = state(Path(tmp))
        ok = kind == "none" or (kind == "file" and replace)
        if ok:
            target = writer.probe_output(path, "--output", replace)
            assert target.path == path and (target.seen is None) == (kind == "none")
        else:
            with pytest.raises(UsageError, match=r"^--output: .*out.json (is|already exists)"):
                writer.probe_output(path, "--output", replace)
        assert state(Path(tmp)) == before  # probing changes nothing


@SETTINGS
@given(kind=st.sampled_from(KINDS), data=DATA)
def test_a_write_replaces_only_a_regular_file_and_never_writes_through_a_link(kind, data):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = make(folder, "summary.json", kind)
        before = state(folder)
        if kind in ("none", "file"):
            assert writer.write_file(path, data) == path
            assert path.read_bytes() == data and not path.is_symlink()
            assert {k: v for k, v in state(folder).items() if k != "summary.json"} == \
                {k: v for k, v in before.items() if k != "summary.json"}  # nothing else, no temporary file
        else:
            with pytest.raises(RunError, match=r"summary.json is .*only a regular file is replaced"):
                writer.write_file(path, data)
            assert state(folder) == before


@SETTINGS
@given(seen=st.sampled_from(["none", "file"]), meanwhile=st.sampled_from(["same", "removed", "new file", "link",
                                                                             "dir", "fifo"]), data=DATA)
def test_an_output_changed_after_its_probe_is_kept_and_ours_goes_beside(seen, meanwhile, data):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = make(folder, "plan.json", seen)
        target = writer.probe_output(path, "--output", replace=True)
        if meanwhile != "same" and seen == "file":
            path.unlink()
        if meanwhile not in ("same", "removed"):
            make(folder, "plan.json", {"new file": "file", "link": "link", "dir": "dir", "fifo": "fifo"}[meanwhile])
        if meanwhile == "new file":
            path.write_bytes(b"the user's result, another size")
        before = state(folder)
        written = writer.write_file(target, data)
        unchanged = meanwhile == "same" or (meanwhile == "removed" and seen == "none")
        if unchanged or (meanwhile == "removed"):
            assert written == path  # nothing there, or still what was probed: ours takes the name
        else:
            assert written == folder / "plan-1.json"
            assert {k: v for k, v in state(folder).items() if k != "plan-1.json"} == before  # theirs kept
        assert written.read_bytes() == data
        assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


@SETTINGS
@given(kind=st.sampled_from(KINDS))
def test_remove_ours_deletes_only_a_file_or_a_link_itself(kind):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = make(folder, ".x.tmp", kind)
        removed = writer.remove_ours(path)
        assert removed == (kind in ("file", "link", "dangling"))
        assert (folder / "theirs").read_bytes() == b"the user's bytes"
        assert (path.exists() or path.is_symlink()) == (kind in ("dir", "fifo"))


@SETTINGS
@given(ours=st.sets(st.sampled_from(["a.md", "b.csv", "c.png", ".list"]), max_size=4),
       theirs=st.sets(st.sampled_from(["notes.txt", "sub", "a.md"]), max_size=3))
def test_a_folder_is_deleted_only_entry_by_entry_and_kept_with_what_is_not_ours(ours, theirs):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "report"
        folder.mkdir()
        for name in ours:
            (folder / name).write_bytes(b"ours")
        for name in theirs - ours:
            if name == "sub":
                (folder / name).mkdir()
                (folder / name / "thesis.tex").write_bytes(b"chapter 1")
            else:
                (folder / name).write_bytes(b"theirs")
        left = writer.remove_folder(folder, sorted(ours))
        assert left == sorted(theirs - ours)
        assert folder.exists() == bool(theirs - ours)
        if "sub" in theirs - ours:
            assert (folder / "sub" / "thesis.tex").read_bytes() == b"chapter 1"


@SETTINGS
@given(old=DATA, new=DATA.filter(bool))
def test_appending_to_a_hard_linked_file_leaves_the_other_name_as_it_was(old, new):
    with tempfile.TemporaryDirectory() as tmp:
        first, second = Path(tmp) / "orig.jsonl", Path(tmp) / "copy.jsonl"
        first.write_bytes(old)
        os.link(first, second)
        fd = writer.open_append(second, "metrics file")
        os.write(fd, new)
        os.close(fd)
        assert first.read_bytes() == old and second.read_bytes() == old + new
        assert first.stat().st_nlink == 1 and second.stat().st_nlink == 1


@SETTINGS
@given(kind=st.sampled_from(KINDS))
def test_a_lock_or_an_append_opens_only_a_regular_file(kind):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = make(folder, ".lock", kind)
        before = state(folder)
        for opener in (lambda: writer.open_lock(path)[0], lambda: writer.open_append(path, "lock file")):
            if kind in ("none", "file"):
                os.close(within(60, opener))
            else:
                with pytest.raises(RunError, match=r"\.lock is .*not the lock file it should be"):
                    within(60, opener)  # O_NONBLOCK: a FIFO without a reader never blocks this
                assert state(folder) == before


@SETTINGS
@given(depth=st.integers(1, 4), at=st.integers(0, 3), kind=st.sampled_from(["link", "file", "fifo", "none"]))
def test_folders_we_own_are_made_without_going_through_a_link(depth, at, kind):
    with tempfile.TemporaryDirectory() as tmp:
        root, outside = Path(tmp) / "cache", Path(tmp) / "outside"
        root.mkdir()
        outside.mkdir()
        parts = [f"d{i}" for i in range(depth)]
        at = min(at, depth - 1)
        (root.joinpath(*parts[:at])).mkdir(parents=True, exist_ok=True)
        planted = root.joinpath(*parts[:at + 1])
        if kind == "link":
            planted.symlink_to(outside)
        elif kind == "file":
            planted.write_bytes(b"x")
        elif kind == "fifo":
            os.mkfifo(planted)
        if kind == "none":
            assert writer.make_folders(root, Path(*parts)) == root.joinpath(*parts)
            assert root.joinpath(*parts).is_dir()
        else:
            with pytest.raises(RunError, match=r"is .*not a folder: refusing to write through it"):
                writer.make_folders(root, Path(*parts))
        assert list(outside.iterdir()) == []


@pytest.mark.parametrize("folder", ["/proc", "/proc/self", "/sys/kernel"])
def test_kernel_file_systems_are_refused_up_front(folder):
    with pytest.raises(UsageError, match=r"^--json: cannot write in .*: /(proc|sys) is a kernel file system"):
        writer.refuse_kernel_fs(Path(folder), "--json")


def test_a_fifo_with_a_reader_is_refused_by_the_check_after_opening(tmp_path):
    """With a reader (`cat fifo` running) opening a FIFO to append succeeds: fstat then refuses it,
    and nothing is written into the pipe."""
    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(RunError, match=r"metrics.jsonl is a named pipe \(FIFO\), not the metrics file"):
            writer.open_append(fifo, "metrics file")
        assert os.read(reader, 10) == b""  # nothing was written through it (its writer is closed)
    finally:
        os.close(reader)
