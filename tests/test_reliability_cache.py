"""Issue 12, compile cache, bench output and argument errors: bad input and faults give one clear
line, nothing outside a cache is read, written or moved, and no partial file is left behind.

Every fixture is built here (caches, crafted archives and manifests); every test runs in-process
through `neuron_train.cli.main`, without torch_xla. The report's cases are in
test_reliability_report.py.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from neuron_train import cli
from neuron_train.common.errors import RunError
from neuron_train.common.fileio import work_path
from neuron_train.cost import bench_result, instance
from neuron_train.cost import sweep as bench_sweep
from neuron_train.precompile import maintenance, store
from neuron_train.precompile.manifest import Manifest, ManifestError, is_cache_file_path
from neuron_train.training import build as training_build

MODULE = "neuronxcc-2.0.0.22266a0+a69f71e55/MODULE_9219523464496887986+abb26765"


def record(data: bytes, by: str = "fp") -> dict:
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "recorded": "2026-11-01T00:00:00Z",
            "recorded_by": by}


def manifest_json(files: dict, configs: dict | None = None) -> dict:
    return {"format": "neuron-train-graph-manifest", "version": 1, "configs": configs or {}, "files": files}


def make_cache(root: Path, files: dict[str, bytes], manifest: dict | None = None) -> Path:
    """A cache holding `files` (relative path -> bytes) and, by default, a manifest recording them."""
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    root.mkdir(parents=True, exist_ok=True)
    if manifest is None:
        manifest = manifest_json({rel: record(data) for rel, data in files.items()})
    (root / store.MANIFEST).write_text(json.dumps(manifest))
    return root


def make_archive(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes (the cache's empty lock files aside)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in (store.USE_LOCK, store.MANIFEST_LOCK)}


# ----------------------------------------------------------------------------- paths stay inside the cache


@pytest.mark.parametrize("key", ["../files/xla/evil", "xla/../../files/xla/evil", "/tmp/xla/evil", "xla/./evil",
                                 "xla/sub/evil", "manifest.json", "quarantine/xla/evil", "", "xla\\..\\evil"])
def test_a_manifest_path_that_is_not_a_cache_file_is_refused(key):
    assert not is_cache_file_path(key)
    with pytest.raises(ManifestError, match="not a file of a compile cache"):
        Manifest.from_json(manifest_json({key: record(b"x")}), "m.json")


def test_cache_file_paths_of_both_layouts_are_accepted():
    assert is_cache_file_path("xla/67939951107342009493273238831484768838")
    assert is_cache_file_path(f"{MODULE}/model.neff")
    assert is_cache_file_path(f"{MODULE}/sub/model.hlo_module.pb")
    assert not is_cache_file_path(MODULE)  # a Neuron entry is a folder, its files are recorded


@pytest.mark.parametrize("entry_already_held", [True, False])
def test_unpack_refuses_an_archive_manifest_pointing_outside(tmp_path, capsys, entry_already_held):
    payload = b"evil bytes"
    archive = make_archive(tmp_path / "a.tar.gz", {
        store.MANIFEST: json.dumps(manifest_json({"xla/evil": record(payload),
                                                  "../files/xla/evil": record(payload)})).encode(),
        "xla/evil": payload})
    cache = tmp_path / "cache"
    if entry_already_held:
        make_cache(cache, {"xla/evil": payload})
    before = tree(cache) if cache.exists() else {}
    code, _, err = run(capsys, "cache", "unpack", "--cache-dir", cache, archive)
    assert code == 1 and "'../files/xla/evil'" in one_line(err) and "refusing to unpack" in err
    assert not (tmp_path / "files").exists()  # nothing written outside the cache
    assert tree(cache) == before              # and nothing inside it either


@pytest.mark.parametrize("quarantine", [False, True])
def test_verify_never_reads_or_moves_a_path_outside_the_cache(tmp_path, capsys, monkeypatch, quarantine):
    victim = tmp_path / "victimdir"
    victim.mkdir()
    (victim / "precious.txt").write_text("precious")
    cache = make_cache(tmp_path / "cache", {"xla/1": b"ok"}, manifest_json(
        {"xla/1": record(b"ok"), "../victimdir/precious.txt": record(b"other bytes")}))
    hashed = []
    monkeypatch.setattr(maintenance, "sha256_file", lambda p: hashed.append(p) or "0" * 64)
    code, out, err = run(capsys, "cache", "verify", "--cache-dir", cache, *(["--quarantine"] if quarantine else []))
    assert code == 1 and "'../victimdir/precious.txt'" in one_line(err)
    assert hashed == [] and out == ""
    assert (victim / "precious.txt").read_text() == "precious"
    assert not (cache / maintenance.QUARANTINE_DIR).exists()


def test_a_cache_folder_that_is_a_link_outside_is_not_followed(tmp_path, capsys):
    """A well-formed key whose folder (xla/) is a symbolic link out of the cache: refused, not read."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    cache = make_cache(tmp_path / "cache", {}, manifest_json({"xla/secret": record(b"other")}))
    (cache / "xla").symlink_to(outside)
    for argv in (["verify", "--quarantine"], ["prune", "--max-size", "0"]):
        code, _, err = run(capsys, "cache", *argv, "--cache-dir", cache)
        assert code == 1 and "points outside" in one_line(err), argv
    assert (outside / "secret").read_bytes() == b"secret"


# ----------------------------------------------------------------------------- damaged manifests: one line


GOOD = record(b"x")


@pytest.mark.parametrize("action, manifest, message", [
    ("verify", manifest_json({"xla/1": {"size": 1, "recorded": "t", "recorded_by": "f"}}), "has no 'sha256' field"),
    ("verify", {**manifest_json({}), "files": []}, "files must be a JSON object, not list"),
    ("verify", manifest_json({"xla/1": {**GOOD, "size": "1"}}), "files['xla/1'].size must be an integer >= 0"),
    ("verify", manifest_json({"xla/1": {**GOOD, "size": -1}}), "files['xla/1'].size must be an integer >= 0"),
    ("verify", manifest_json({"xla/1": {**GOOD, "sha256": "abc"}}), "is not a SHA-256"),
    ("verify", {"format": "neuron-train-graph-manifest", "version": 1, "configs": {}}, "has no 'files' field"),
    ("list", manifest_json({}, {"fp": {"graphs": {}}}), "configs['fp'] has no 'config' field"),
    ("list", manifest_json({}, {"fp": {"config": {}, "graphs": "x"}}), "configs['fp'].graphs must be a JSON object"),
    ("list", manifest_json({}, {"fp": {"config": {}, "graphs": {"h": {"step": -2}}}}), ".step must be an integer"),
    ("list", manifest_json({}, {"fp": {"config": {}, "graphs": {"h": {"compile_time_s": float("nan")}}}}),
     "compile_time_s must be a finite number"),
    ("list", manifest_json({}, {"fp": {"config": {}, "graphs": {}, "pruned_files": True}}), "pruned_files"),
    ("list", manifest_json({"xla/1": {**GOOD, "recorded_by": []}}), "recorded_by must be a string"),
    ("list", [1, 2], "not a neuron-train graph manifest (not a JSON object)"),
])
def test_a_damaged_manifest_is_one_line_and_exit_1(tmp_path, capsys, action, manifest, message):
    cache = make_cache(tmp_path / "cache", {"xla/1": b"x"}, manifest)
    code, out, err = run(capsys, "cache", action, "--cache-dir", cache)
    assert code == 1 and message in one_line(err) and "move it aside" in err
    assert out == ""


@pytest.mark.parametrize("manifest, message", [
    ({"format": "neuron-train-graph-manifest", "version": 1, "configs": {}}, "has no 'files' field"),
    ({**manifest_json({}), "configs": []}, "configs must be a JSON object"),
    (manifest_json({"xla/1": {**GOOD, "sha256": 5}}), "sha256 must be a string"),
    ({**manifest_json({}), "version": 7}, "version 7 is not supported (this neuron-train reads version 1)"),
])
def test_a_damaged_archive_manifest_is_one_line(tmp_path, capsys, manifest, message):
    archive = make_archive(tmp_path / "a.tar.gz", {store.MANIFEST: json.dumps(manifest).encode()})
    code, _, err = run(capsys, "cache", "unpack", "--cache-dir", tmp_path / "cache", archive)
    assert code == 1 and message in one_line(err)
    assert not (tmp_path / "cache" / store.MANIFEST).exists()


def test_unknown_fields_survive_a_rewrite(tmp_path):
    """Fields this version does not know are kept, not dropped, when the manifest is rewritten."""
    cache = make_cache(tmp_path / "cache", {"xla/1": b"x"}, {
        **manifest_json({"xla/1": {**record(b"x"), "origin": "host-a"}},
                        {"fp": {"config": {"model": "m"}, "graphs": {"h": {"phase": "train", "note": 1}},
                                "owner": "team"}}), "comment": "kept"})
    store.update_manifest(cache, lambda m: None)
    data = json.loads((cache / store.MANIFEST).read_text())
    assert data["comment"] == "kept" and data["files"]["xla/1"]["origin"] == "host-a"
    assert data["configs"]["fp"]["owner"] == "team" and data["configs"]["fp"]["graphs"]["h"]["note"] == 1


# ----------------------------------------------------------------------------- verify never says OK about nothing


def test_verify_without_a_manifest_does_not_say_ok(tmp_path, capsys):
    cache = tmp_path / "cache"
    (cache / "xla").mkdir(parents=True)
    (cache / "xla" / "1").write_bytes(b"x")
    code, out, err = run(capsys, "cache", "verify", "--cache-dir", cache)
    assert code == 1 and "has no manifest.json" in one_line(err) and "OK" not in out


def test_verify_with_nothing_recorded_says_nothing_was_verified(tmp_path, capsys):
    cache = make_cache(tmp_path / "cache", {"xla/1": b"x"}, manifest_json({}))
    code, out, _ = run(capsys, "cache", "verify", "--cache-dir", cache)
    assert code == 1 and "nothing verified" in out and ": OK" not in out
    assert "1 not recorded, not checked" in out


def test_verify_an_empty_cache_says_so(tmp_path, capsys):
    (tmp_path / "cache").mkdir()
    code, out, _ = run(capsys, "cache", "verify", "--cache-dir", tmp_path / "cache")
    assert code == 0 and "empty cache, nothing to verify" in out


# ----------------------------------------------------------------------------- prune


@pytest.mark.parametrize("flag, value", [("--max-size", "nan"), ("--max-size", "inf"), ("--max-size", "-1G"),
                                         ("--max-size", "1e400G"), ("--max-size", "NaNM"),
                                         ("--older-than", "nand"), ("--older-than", "infd"),
                                         ("--older-than", "-1d"), ("--older-than", "d")])
def test_prune_refuses_sizes_and_ages_that_are_not_numbers(tmp_path, capsys, flag, value):
    cache = make_cache(tmp_path / "cache", {"xla/1": b"x" * 100})
    os.utime(cache / "xla" / "1", (1, 1))
    code, out, err = run(capsys, "cache", "prune", "--cache-dir", cache, f"{flag}={value}")
    assert code == 2 and repr(value) in one_line(err) and out == ""
    assert (cache / "xla" / "1").exists()


def test_prune_announces_nothing_before_refusing_a_cache_in_use(tmp_path, capsys):
    cache = make_cache(tmp_path / "cache", {"xla/1": b"x" * 100})
    os.utime(cache / "xla" / "1", (1, 1))
    use = store.CacheUse(cache)  # what a running precompile or training run holds
    try:
        code, out, err = run(capsys, "cache", "prune", "--cache-dir", cache, "--older-than", "1d")
    finally:
        use.release()
    assert code == 1 and "in use" in one_line(err)
    assert "delete" not in out and (cache / "xla" / "1").exists()
    code, out, _ = run(capsys, "cache", "prune", "--cache-dir", cache, "--older-than", "1d")
    assert code == 0 and out.startswith("delete xla/1 ") and not (cache / "xla" / "1").exists()


# ----------------------------------------------------------------------------- pack: no partial archive


def test_pack_to_a_full_disk_leaves_no_partial_archive(tmp_path, capsys, monkeypatch):
    """ENOSPC raised by the real write path (gzip) after part of the archive is on disk."""
    cache = make_cache(tmp_path / "cache", {"xla/1": os.urandom(300_000)})
    out = tmp_path / "out"
    out.mkdir()
    real_write, calls = gzip.GzipFile.write, []

    def write_until_full(self, data):
        calls.append(len(data))
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(gzip.GzipFile, "write", write_until_full)
    code, _, err = run(capsys, "cache", "pack", "--cache-dir", cache, out / "warm.tar.gz")
    assert code == 1 and "No space left on device" in one_line(err) and "removed" in err
    assert len(calls) > 2 and list(out.iterdir()) == []
    assert not list(cache.glob(f"{store.STAGING_DIR}*"))


def test_pack_without_hard_links_still_never_overwrites(tmp_path, capsys, monkeypatch):
    cache = make_cache(tmp_path / "cache", {"xla/1": b"graph"})

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    code, out, _ = run(capsys, "cache", "pack", "--cache-dir", cache, tmp_path / "warm.tar.gz")
    assert code == 0 and "packed 1 entries" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "warm.tar.gz"]
    with tarfile.open(tmp_path / "warm.tar.gz") as tar:
        assert tar.extractfile("xla/1").read() == b"graph"


def test_pack_removes_a_dead_packs_partial_archive_and_keeps_a_live_ones(tmp_path, capsys):
    cache = make_cache(tmp_path / "cache", {"xla/1": b"graph"})
    dest = tmp_path / "warm.tar.gz"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ours = work_path(dest, "part")
        stale = ours.with_name(ours.name.rsplit("-", 1)[0] + f"-{dead.pid}")
        running = ours.with_name(ours.name.rsplit("-", 1)[0] + f"-{live.pid}")
        stale.write_bytes(b"half an archive")
        running.write_bytes(b"being written")
        code, _, _ = run(capsys, "cache", "pack", "--cache-dir", cache, dest)
        assert code == 0 and dest.is_file()
        assert not stale.exists() and running.read_bytes() == b"being written"
    finally:
        live.kill()
        live.wait(timeout=60)


# ----------------------------------------------------------------------------- argparse: one line


@pytest.mark.parametrize("argv, message, help_of", [
    (["cache", "prune", "--max-size"], "argument --max-size: expected one argument", "cache prune"),
    (["cache", "frobnicate"], "invalid choice: 'frobnicate'", "cache"),
    (["report", "x.json"], "the following arguments are required: --out", "report"),
    (["train", "--epochs", "x"], "argument --epochs: invalid int value: 'x'", "train"),
    (["bench", "--mode", "infer", "--output", "r.json", "--sweep-batch-sizes", "8,x"], "expected comma-separated",
     "bench"),
    (["precompile", "--", "--epochs", "x"], "argument --epochs: invalid int value: 'x'", "train"),
    (["frobnicate"], "invalid choice: 'frobnicate'", ""),
])
def test_argument_errors_are_one_line_with_where_the_help_is(capsys, argv, message, help_of):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in one_line(err) and "usage:" not in err and out == ""
    assert err.rstrip().endswith(f"(see `{' '.join(['neuron-train', *help_of.split()])} --help`)"), err


def test_help_still_prints_the_usage(capsys):
    code, out, _ = run(capsys, "cache", "prune", "--help")
    assert code == 0 and out.startswith("usage: neuron-train cache prune")


# ----------------------------------------------------------------------------- bench: outputs checked first


@pytest.fixture
def no_measuring(monkeypatch):
    """Anything that would start measuring fails the test: the refusals must come before it."""
    def measuring(*args, **kwargs):
        raise AssertionError("bench started measuring before refusing its --output")

    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for module, name in ((training_build, "build_data"), (bench_sweep, "measure_train"),
                         (bench_sweep, "InferBench"), (instance, "detect_instance_type")):
        monkeypatch.setattr(module, name, measuring)


@pytest.mark.parametrize("force", [False, True])
def test_bench_refuses_a_directory_output_before_measuring(tmp_path, capsys, no_measuring, force):
    (tmp_path / "results").mkdir()
    code, _, err = run(capsys, "bench", "--mode", "infer", "--output", tmp_path / "results",
                       *(["--force"] if force else []))
    assert code == 2 and "is a directory" in one_line(err)


def test_bench_refuses_an_output_under_a_file_before_measuring(tmp_path, capsys, no_measuring):
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = run(capsys, "bench", "--mode", "infer", "--output", tmp_path / "notes.txt" / "r.json")
    assert code == 2 and "is not a folder" in one_line(err)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only folder")
def test_bench_refuses_a_read_only_folder_before_measuring(tmp_path, capsys, no_measuring):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    code, _, err = run(capsys, "bench", "--mode", "infer", "--output", folder / "r.json")
    assert code == 2 and "not writable" in one_line(err)


def test_bench_prints_the_result_when_it_cannot_be_written_and_leaves_no_temporary_file(tmp_path, capsys,
                                                                                         monkeypatch):
    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(RunError, match="No space left on device; the result is printed above"):
        bench_result.write_result(tmp_path / "r.json", {"schema": "neuron-train-bench-result", "x": 1})
    assert json.loads(capsys.readouterr().out)["x"] == 1
    assert list(tmp_path.iterdir()) == []
