"""Issue 21, compile cache: no cache command changes a folder that is not a cache, prune deletes
only what it can vouch for, unpack says a full disk or a read-only mount in one line and cleans up
after a process killed mid-unpack. Real faults: a tmpfs that fills up, a read-only mount, kill -9.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuron_train.precompile import store
from tests.conftest import ROOT, cpu_env
from tests.fullfs import mounted_tmpfs
from tests.precompile.test_reliability_cache import (
    MODULE,
    make_archive,
    make_cache,
    manifest_json,
    one_line,
    record,
    run,
)


def everything(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` (hidden and lock files too) with its bytes (None for a folder)."""
    return {p.relative_to(root).as_posix(): (None if p.is_dir() else p.read_bytes())
            for p in sorted(root.rglob("*"))}


def not_a_cache(tmp_path: Path) -> Path:
    d = tmp_path / "d"
    (d / "xla").mkdir(parents=True)
    (d / "xla" / "thesis.tex").write_text("x\n")
    os.utime(d / "xla" / "thesis.tex", (time.time() - 90 * 86400,) * 2)
    return d


@pytest.mark.parametrize("argv", [["prune", "--older-than", "0s"], ["prune", "--max-size", "0"],
                                  ["prune", "--failed"], ["verify", "--quarantine"], ["pack", "PACK"],
                                  ["unpack", "ARCHIVE"]])
def test_no_cache_command_changes_a_folder_that_is_not_a_cache(tmp_path, capsys, argv):
    d = not_a_cache(tmp_path)
    archive = make_archive(tmp_path / "a.tar.gz", {store.MANIFEST: json.dumps(manifest_json(
        {"xla/1": record(b"g")})).encode(), "xla/1": b"g"})
    argv = [{"PACK": tmp_path / "p.tar.gz", "ARCHIVE": archive}.get(a, a) for a in argv]
    before = everything(d)
    code, _, err = run(capsys, "cache", argv[0], "--cache-dir", d, *argv[1:])
    assert code in (1, 2) and "is not a compile cache" in one_line(err) and "--adopt" in err
    assert everything(d) == before  # no file deleted, no manifest, no lock file written
    assert not (tmp_path / "p.tar.gz").exists()


def test_prune_deletes_only_what_it_can_vouch_for_even_with_adopt(tmp_path, capsys):
    d = not_a_cache(tmp_path)
    code, out, _ = run(capsys, "cache", "prune", "--cache-dir", d, "--older-than", "0s", "--adopt")
    assert code == 0 and "kept 1 entry" in out and "xla/thesis.tex" in out
    assert (d / "xla" / "thesis.tex").read_text() == "x\n"
    assert not (d / store.MANIFEST).exists()  # a folder without a manifest does not get one


def test_prune_keeps_unrecorded_files_and_foreign_files_in_module_folders(tmp_path, capsys):
    compiled = {f"{MODULE}/model.neff": b"neff", f"{MODULE}/model.done": b"",
                f"{MODULE}/model.hlo_module.pb": b"hlo"}
    other = MODULE.replace("MODULE_9", "MODULE_7")
    cache = make_cache(tmp_path / "c", {"xla/recorded": b"g", **compiled},
                       manifest_json({"xla/recorded": record(b"g")}))
    for rel, data in {"xla/unrecorded": b"mine", f"{other}/model.neff": b"n",
                      f"{other}/notes.txt": b"my notes"}.items():
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_bytes(data)
    for p in cache.rglob("*"):
        os.utime(p, (time.time() - 90 * 86400,) * 2)
    code, out, _ = run(capsys, "cache", "prune", "--cache-dir", cache, "--older-than", "1d")
    assert code == 0, out
    assert not (cache / "xla" / "recorded").exists() and not (cache / MODULE).exists()  # ours: deleted
    assert (cache / "xla" / "unrecorded").read_bytes() == b"mine"          # not vouched for: kept
    assert (cache / other / "notes.txt").read_bytes() == b"my notes" and (cache / other / "model.neff").exists()
    assert "kept 2 entries" in out


def test_a_neuron_compiler_cache_without_a_manifest_is_a_cache(tmp_path, capsys):
    cache = tmp_path / "neuron"
    (cache / MODULE).mkdir(parents=True)
    (cache / MODULE / "model.log").write_text("Failed compilation with [neuronx-cc]: boom\n")
    code, out, err = run(capsys, "cache", "prune", "--cache-dir", cache, "--failed")
    assert code == 0 and f"delete {MODULE}" in out, err
    assert not (cache / MODULE).exists() and not (cache / store.MANIFEST).exists()


# ----------------------------------------------------------------------------- unpack: real faults


def test_unpack_onto_a_regular_file_or_into_a_read_only_mount_is_one_line(tmp_path, capsys):
    archive = make_archive(tmp_path / "a.tar.gz", {store.MANIFEST: json.dumps(manifest_json(
        {"xla/1": record(b"g")})).encode(), "xla/1": b"g"})
    (tmp_path / "file").write_text("keep")
    code, _, err = run(capsys, "cache", "unpack", "--cache-dir", tmp_path / "file", archive)
    assert code == 2 and "is a file, not a folder" in one_line(err)
    assert (tmp_path / "file").read_text() == "keep"
    with mounted_tmpfs(tmp_path / "ro", read_only=True) as ro:
        for target in (ro, ro / "cache"):
            code, _, err = run(capsys, "cache", "unpack", "--cache-dir", target, archive)
            assert code == 2 and "Traceback" not in one_line(err), err
            assert "not writable" in err or "Read-only file system" in err


def test_unpack_onto_a_full_disk_says_no_space_and_leaves_nothing(tmp_path, capsys):
    big = os.urandom(2 * 1024 * 1024)  # larger than the 1 MiB file system
    archive = make_archive(tmp_path / "a.tar.gz", {store.MANIFEST: json.dumps(manifest_json(
        {"xla/big": record(big)})).encode(), "xla/big": big})
    with mounted_tmpfs(tmp_path / "small", size="1m") as small:
        code, _, err = run(capsys, "cache", "unpack", "--cache-dir", small / "cache", archive)
        assert code == 1 and "no space left" in one_line(err) and "damaged" not in err
        assert sorted(p.name for p in (small / "cache").iterdir()) == [store.USE_LOCK]  # no staging left


def test_an_oversized_member_is_refused_before_it_is_extracted(tmp_path, capsys, monkeypatch):
    big = os.urandom(300_000)
    archive = make_archive(tmp_path / "a.tar.gz", {store.MANIFEST: json.dumps(manifest_json(
        {"xla/big": record(big[:10])})).encode(), "xla/big": big})
    import tarfile
    extracted = []
    real = tarfile.TarFile.extract
    monkeypatch.setattr(tarfile.TarFile, "extract",
                        lambda self, m, *a, **k: extracted.append(m.name) or real(self, m, *a, **k))
    code, _, err = run(capsys, "cache", "unpack", "--cache-dir", tmp_path / "c", archive)
    assert code == 1 and "member xla/big is 300000 bytes, its manifest says 10" in one_line(err)
    assert extracted == []


@pytest.mark.slow
def test_the_staging_folder_of_an_unpack_killed_with_kill_9_is_removed_by_the_next_one(tmp_path):
    big = os.urandom(40 * 1024 * 1024)
    files = {f"xla/{i}": big[i::4] for i in range(4)}
    archive = make_archive(tmp_path / "a.tar.gz", {store.MANIFEST: json.dumps(manifest_json(
        {rel: record(data) for rel, data in files.items()})).encode(), **files})
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "neuron_train.cli", "cache", "unpack", "--cache-dir", str(cache), str(archive)]
    proc = subprocess.Popen(cmd, env=cpu_env(), cwd=ROOT)
    deadline = time.time() + 120
    while time.time() < deadline and not list(cache.glob(".staging*/files/xla/*")):
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)  # mid-extraction
    proc.wait(timeout=60)
    left = list(cache.glob(".staging*"))
    assert left, "the unpack finished before it could be killed: use a larger archive"
    done = subprocess.run(cmd, env=cpu_env(), cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not list(cache.glob(".staging*")) and (cache / "xla" / "3").read_bytes() == files["xla/3"]
