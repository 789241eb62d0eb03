"""The compile cache's rules from the reliability reviews, in-process: `cache prune`, `verify`, `pack`
and `unpack` on linked and relative paths, folders that are not caches, a full quota, a killed prune,
a read-only mount, a protected file, an unreadable manifest. Each bad row of issue 31 (round 4) and
issue 42 (round 5) fixed as a rule; each test was seen failing with its rule removed
(docs/reliability.md). The rounds' tests of other modules sit beside theirs:
tests/common/test_reader_guards.py, tests/cost/test_report_rules.py, tests/cost/test_plan_rules.py,
tests/commands/test_interrupts.py."""

from __future__ import annotations

import errno
import json
import os
import tarfile
import time
from pathlib import Path

import pytest

from neuron_train import cli
from neuron_train.precompile import store
from tests.precompile.test_reliability_cache import MODULE, make_cache, manifest_json, one_line, record, run

OLD = time.time() - 90 * 86400


def age(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        os.utime(p, (OLD, OLD), follow_symlinks=False)


def compiled_entry(module: str = MODULE) -> dict[str, bytes]:
    return {f"{module}/model.neff": b"neff", f"{module}/model.done": b"", f"{module}/model.hlo_module.pb": b"hlo",
            f"{module}/compile_flags.json": b"[]"}


# ----------------------------------------------------------------------------- cache prune


@pytest.mark.parametrize("how", ["relative", "symlink"])
def test_prune_of_a_neuron_cache_given_as_a_relative_or_linked_path_deletes_its_entries(tmp_path, capsys,
                                                                                        monkeypatch, how):
    """Bad row 1: `relative_to` crashed on every MODULE_ entry after printing `delete`."""
    real = make_cache(tmp_path / "real", compiled_entry(), manifest_json({}))
    age(real)
    if how == "relative":
        monkeypatch.chdir(tmp_path)
        given: str | Path = "real"
    else:
        given = tmp_path / "link"
        given.symlink_to(real)
    code, out, err = run(capsys, "cache", "prune", "--cache-dir", given, "--older-than", "1d")
    assert code == 0 and f"delete {MODULE}" in out, err
    assert not (real / MODULE).exists()


def test_a_compiler_artifact_name_deeper_than_a_module_folder_is_not_vouched_for(tmp_path, capsys):
    """Mutant: compiler-artifact names vouched for at any depth. `MODULE_x/sub/model.neff` is not
    what the compiler writes: the entry is kept, whole."""
    cache = make_cache(tmp_path / "c", compiled_entry(), manifest_json({}))
    (cache / MODULE / "sub").mkdir()
    (cache / MODULE / "sub" / "model.neff").write_bytes(b"someone's file")
    age(cache)
    code, out, _ = run(capsys, "cache", "prune", "--cache-dir", cache, "--older-than", "1d")
    assert code == 0 and "kept 1 entry" in out
    assert (cache / MODULE / "sub" / "model.neff").read_bytes() == b"someone's file"
    assert (cache / MODULE / "model.neff").exists()


@pytest.mark.parametrize("lock", [store.USE_LOCK, store.MANIFEST_LOCK])
def test_one_of_our_lock_files_beside_other_files_does_not_make_a_folder_a_cache(tmp_path, capsys, lock):
    """Mutant: a folder counted as a cache when any (not every) file in it is one of ours."""
    d = tmp_path / "d"
    (d / "xla").mkdir(parents=True)
    (d / "xla" / "thesis.tex").write_text("x\n")
    (d / lock).write_text("")
    age(d)
    code, _, err = run(capsys, "cache", "prune", "--cache-dir", d, "--older-than", "0s")
    assert code == 2 and "is not a compile cache" in one_line(err)
    assert (d / "xla" / "thesis.tex").read_text() == "x\n"


def test_our_lock_files_alone_are_an_empty_cache(tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    (d / store.USE_LOCK).write_text("")
    code, out, err = run(capsys, "cache", "prune", "--cache-dir", d, "--older-than", "0s")
    assert code == 0, err


# ----------------------------------------------------------------- EDQUOT (the writers': tests/common/test_fileio.py)


def test_a_quota_exceeded_while_unpacking_is_a_full_disk(tmp_path, capsys, monkeypatch):
    from tests.precompile.test_reliability_cache import make_archive

    arc = make_archive(tmp_path / "a.tar.gz", {store.MANIFEST: json.dumps(manifest_json(
        {"xla/1": record(b"g")})).encode(), "xla/1": b"g"})

    def no_quota(*args, **kwargs):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(tarfile.TarFile, "extract", no_quota)  # archive._extract_verified's write
    code, _, err = run(capsys, "cache", "unpack", arc, "--cache-dir", tmp_path / "c")
    assert code == 1 and "no space left on the device" in one_line(err)


# ----------------------------------------------------------------------------- weak rows


def test_verify_after_a_killed_prune_says_why_files_are_missing(tmp_path, capsys):
    """Weak row: after kill -9 during `cache prune`, verify listed the deleted files as `missing`
    with no hint (the manifest is rewritten only at the end). A killed prune leaves its mark."""
    import socket

    cache = make_cache(tmp_path / "c", {"xla/1": b"a", "xla/2": b"b"})
    (cache / "xla" / "1").unlink()  # deleted by the prune that was then killed
    mark = cache / f".prune.running-{socket.gethostname()}-999999999"  # a process id no process has
    mark.touch()
    code, out, _ = run(capsys, "cache", "verify", "--cache-dir", cache)
    assert code == 1 and "missing" in out and "a `cache prune` was killed before it finished" in out
    code, out, _ = run(capsys, "cache", "verify", "--cache-dir", cache, "--quarantine")
    assert not mark.exists()
    code, out, _ = run(capsys, "cache", "verify", "--cache-dir", cache)
    assert code == 0 and "killed" not in out


def test_a_prune_leaves_no_mark_when_it_finishes(tmp_path, capsys):
    cache = make_cache(tmp_path / "c", {"xla/1": b"a"})
    age(cache)
    code, out, _ = run(capsys, "cache", "prune", "--cache-dir", cache, "--older-than", "1d")
    assert code == 0 and "delete xla/1" in out
    assert not list(cache.glob(".prune.*"))


def test_pack_vouches_only_for_what_prune_would(tmp_path, capsys):
    """Weak row: `cache pack` recorded user files prune refuses to vouch for; unpacked into another
    cache they were recorded there, and a prune there deleted them."""
    cache = make_cache(tmp_path / "c", {"xla/1": b"graph"})
    (cache / "xla" / "notes").write_bytes(b"mine")
    code, out, err = run(capsys, "cache", "pack", "--cache-dir", cache, tmp_path / "p.tar.gz")
    assert code == 0, err
    with tarfile.open(tmp_path / "p.tar.gz") as tar:
        names = tar.getnames()
        packed = json.loads(tar.extractfile(store.MANIFEST).read())  # type: ignore[union-attr]
    assert "xla/1" in names and "xla/notes" not in names and "xla/notes" not in packed["files"]
    assert "left out 1" in out


# ----------------------------------------------------------------------------- round 5 (issue 42)


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
