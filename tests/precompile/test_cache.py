"""The compile cache tools: layout, manifest, checksums, verify, prune, pack/unpack, locking.

Fast tests on cache directories built with the real Neuron layout (tests/fixtures/precompile/README.md)
and torch_xla-style xla/ files; the end-to-end precompile runs are in test_precompile.py.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from neuron_train.common.errors import RunError, UsageError
from neuron_train.precompile import archive, maintenance, store
from neuron_train.precompile.manifest import ConfigRecord, FileRecord, GraphRecord, Manifest, entry_of
from tests.conftest import ROOT, cpu_env

FIXTURES = ROOT / "tests" / "fixtures" / "precompile"
VERSION_DIR = "neuronxcc-2.0.0.22266a0+a69f71e55"  # as in the Neuron docs' log lines
CONFIG = {"model": "vit-nano", "img_size": 32, "batch_size": 32, "precision": "fp32", "world_size": 1,
          "device": "CPU"}


def neuron_entry(cache: Path, name: str, state: str) -> Path:
    d = cache / VERSION_DIR / name
    d.mkdir(parents=True)
    (d / "model.hlo_module.pb").write_bytes(os.urandom(300))
    (d / "compile_flags.json").write_text('["--model-type=transformer"]')
    if state == "compiled":
        (d / "model.neff").write_bytes(b"placeholder NEFF payload " + os.urandom(2000))
        (d / "model.done").write_bytes(b"")
    elif state == "failed":
        (d / "model.log").write_text((FIXTURES / "failed_compile_model.log").read_text())
    elif state == "locked":
        (d / "model.hlo_module.pb.lock").write_bytes(b"")
    return d


def xla_entry(cache: Path, name: str, size: int = 1500) -> Path:
    (cache / store.XLA_DIR).mkdir(parents=True, exist_ok=True)
    f = cache / store.XLA_DIR / name
    f.write_bytes(os.urandom(size))
    return f


def add_config(cache: Path, fp: str, config: dict, graphs: dict[str, GraphRecord]) -> None:
    def add(m: Manifest) -> None:
        m.configs[fp] = ConfigRecord(config=config, graphs=graphs, precompile_ids=["t"], updated=store.utc_now(),
                                     host="test")
    store.update_manifest(cache, add)


@pytest.fixture
def cache(tmp_path) -> Path:
    """A cache with two compiled Neuron entries, one failed, one locked, one extracted-only, two xla files."""
    c = tmp_path / "cache"
    neuron_entry(c, "MODULE_9219523464496887986+abb26765", "compiled")
    neuron_entry(c, "MODULE_8068656800389078395+abb26765", "compiled")
    neuron_entry(c, "MODULE_02e0833b58066ea94f2c+2c2d707e", "failed")
    neuron_entry(c, "MODULE_17109392703413819652+abb26765", "locked")
    neuron_entry(c, "MODULE_3000743782456078279+abb26765", "incomplete")
    xla_entry(c, "67939951107342009493273238831484768838")
    xla_entry(c, "123116424461872025944304137096563822046", size=4000)
    add_config(c, "aaaaaaaaaaaaaaaa", CONFIG, {"h1": GraphRecord(phase="train", step=0)})
    assert len(store.record_entries(c, "aaaaaaaaaaaaaaaa")) == 4
    return c


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "neuron_train", "cache", *args], capture_output=True,
                          text=True, env=cpu_env(), cwd=cwd, timeout=120)


# ----------------------------------------------------------------------------- layout


def test_scan_classifies_the_neuron_layout_and_xla_files(cache):
    states = {e.path: e.state for e in store.scan(cache)}
    assert states[f"{VERSION_DIR}/MODULE_9219523464496887986+abb26765"] == store.COMPILED
    assert states[f"{VERSION_DIR}/MODULE_02e0833b58066ea94f2c+2c2d707e"] == store.FAILED
    assert states[f"{VERSION_DIR}/MODULE_17109392703413819652+abb26765"] == store.LOCKED
    assert states[f"{VERSION_DIR}/MODULE_3000743782456078279+abb26765"] == store.INCOMPLETE
    assert states["xla/67939951107342009493273238831484768838"] == store.FILE
    assert len(states) == 7
    locked = next(e for e in store.scan(cache) if e.state == store.LOCKED)
    assert not any(f.endswith(".lock") for f in locked.files)  # lock files are never checksummed


def test_only_finished_entries_are_recorded(cache):
    files = store.load_manifest(cache).files
    entries = {entry_of(f) for f in files}
    assert entries == {f"{VERSION_DIR}/MODULE_9219523464496887986+abb26765",
                       f"{VERSION_DIR}/MODULE_8068656800389078395+abb26765",
                       "xla/67939951107342009493273238831484768838",
                       "xla/123116424461872025944304137096563822046"}
    rec = files[f"{VERSION_DIR}/MODULE_9219523464496887986+abb26765/model.neff"]
    assert rec.recorded_by == "aaaaaaaaaaaaaaaa" and len(rec.sha256) == 64
    assert store.record_entries(cache, "bbbb") == []  # nothing new: records are not overwritten


def test_commit_staged_moves_new_files_and_keeps_the_first_copy(tmp_path):
    c, staging = tmp_path / "cache", tmp_path / "cache" / store.STAGING_DIR / "p1"
    staging.mkdir(parents=True)
    (staging / "111").write_bytes(b"first")
    assert store.commit_staged(c, staging, "fp1") == 1 and not staging.exists()
    staging.mkdir(parents=True)
    (staging / "111").write_bytes(b"second copy, other bytes")  # same graph, other serialisation
    (staging / "222").write_bytes(b"new")
    assert store.commit_staged(c, staging, "fp2") == 1
    assert (c / "xla" / "111").read_bytes() == b"first"
    assert [f for f in maintenance.verify(c) if f.problem in maintenance.BAD_FINDINGS] == []


# ----------------------------------------------------------------------------- verify


def test_verify_passes_a_sound_cache_but_reports_failed_compiles(cache):
    findings = maintenance.verify(cache)
    problems = {f.problem for f in findings}
    assert problems == {"failed", "locked", "incomplete"}
    failed = next(f for f in findings if f.problem == "failed")
    assert "LUR015" in failed.detail  # the compiler's own reason, from model.log


def test_truncated_and_modified_entries_are_caught(cache):
    neff = cache / VERSION_DIR / "MODULE_9219523464496887986+abb26765" / "model.neff"
    neff.write_bytes(neff.read_bytes()[:100])  # truncated
    xla = cache / "xla" / "67939951107342009493273238831484768838"
    data = bytearray(xla.read_bytes())
    data[10] ^= 0xFF  # same size, one byte flipped
    xla.write_bytes(bytes(data))
    corrupt = {f.entry: f.detail for f in maintenance.verify(cache) if f.problem == "corrupt"}
    assert set(corrupt) == {f"{VERSION_DIR}/MODULE_9219523464496887986+abb26765",
                            "xla/67939951107342009493273238831484768838"}
    assert corrupt[f"{VERSION_DIR}/MODULE_9219523464496887986+abb26765"].startswith("model.neff: 100 bytes")
    assert "truncated" in corrupt[f"{VERSION_DIR}/MODULE_9219523464496887986+abb26765"]
    assert "checksum" in corrupt["xla/67939951107342009493273238831484768838"]


@pytest.mark.slow
def test_cli_verify_exit_codes_and_quarantine(cache):
    clean_failed = cli("prune", "--cache-dir", str(cache), "--failed")
    assert clean_failed.returncode == 0, clean_failed.stderr
    ok = cli("verify", "--cache-dir", str(cache))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK" in ok.stdout
    neff = cache / VERSION_DIR / "MODULE_8068656800389078395+abb26765" / "model.neff"
    neff.write_bytes(b"tampered")
    bad = cli("verify", "--cache-dir", str(cache))
    assert bad.returncode == 1 and "corrupt" in bad.stdout and "MODULE_8068656800389078395" in bad.stdout
    fixed = cli("verify", "--cache-dir", str(cache), "--quarantine")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    moved = list((cache / maintenance.QUARANTINE_DIR).glob(
        f"*/{VERSION_DIR}/MODULE_8068656800389078395+abb26765/model.neff"))
    assert len(moved) == 1 and moved[0].read_bytes() == b"tampered"  # moved aside, not deleted
    assert store.load_manifest(cache).configs["aaaaaaaaaaaaaaaa"].pruned_files == 4  # no longer warm
    assert cli("verify", "--cache-dir", str(cache)).returncode == 0


@pytest.mark.slow
def test_a_damaged_manifest_is_a_clear_error(tmp_path):
    c = tmp_path / "c"
    c.mkdir()
    (c / store.MANIFEST).write_text('{"format": "neuron-train-graph-manifest", "vers')
    with pytest.raises(RunError, match="damaged"):
        store.load_manifest(c)
    (c / store.MANIFEST).write_text('{"something": "else"}')
    with pytest.raises(RunError, match="not a neuron-train graph manifest"):
        store.load_manifest(c)
    proc = cli("list", "--cache-dir", str(c))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- prune


def entry(path: str, size: int, age: float, state: str = store.COMPILED) -> store.Entry:
    return store.Entry(path=path, state=state, files=(), size=size, mtime=1_000_000 - age)


def test_select_prune_by_age_size_and_failure_never_locked():
    es = [entry("old", 100, 90 * 86400), entry("mid", 100, 10 * 86400), entry("new", 100, 60),
          entry("oldlocked", 500, 99 * 86400, store.LOCKED), entry("failed", 10, 60, store.FAILED)]
    now = 1_000_000
    assert [e.path for e in maintenance.select_prune(es, now=now, older_than=30 * 86400)] == ["old"]
    assert [e.path for e in maintenance.select_prune(es, now=now, failed=True)] == ["failed"]
    # 810 bytes, at most 650: oldest unlocked first until it fits (the locked 500 stay).
    assert [e.path for e in maintenance.select_prune(es, now=now, max_size=650)] == ["old", "mid"]
    assert maintenance.select_prune(es, now=now, max_size=10_000) == []


@pytest.mark.parametrize("text,value", [("500M", 500 * 1024**2), ("20G", 20 * 1024**3), ("1.5T", int(1.5 * 1024**4)),
                                        ("2GiB", 2 * 1024**3), ("123", 123)])
def test_parse_size(text, value):
    assert maintenance.parse_size(text) == value


def test_parse_age_and_bad_input():
    assert (maintenance.parse_age("30d") == 30 * 86400 and maintenance.parse_age("12h") == 43200
            and maintenance.parse_age("2w") == 14 * 86400)
    for bad in ("30", "d", "-3d", "3y"):
        with pytest.raises(UsageError):
            maintenance.parse_age(bad)
    with pytest.raises(UsageError):
        maintenance.parse_size("lots")


@pytest.mark.slow
def test_prune_deletes_oldest_and_marks_the_configuration(cache):
    old = cache / "xla" / "67939951107342009493273238831484768838"
    os.utime(old, (time.time() - 40 * 86400,) * 2)
    proc = cli("prune", "--cache-dir", str(cache), "--older-than", "30d")
    assert proc.returncode == 0, proc.stderr
    assert not old.exists()
    m = store.load_manifest(cache)
    assert "xla/67939951107342009493273238831484768838" not in m.files
    assert m.configs["aaaaaaaaaaaaaaaa"].pruned_files == 1
    assert [f for f in maintenance.verify(cache) if f.problem in ("missing", "corrupt")] == []


@pytest.mark.slow
def test_prune_refuses_while_the_cache_is_in_use(cache):
    old = cache / "xla" / "67939951107342009493273238831484768838"
    os.utime(old, (time.time() - 40 * 86400,) * 2)
    use = store.CacheUse(cache)  # what a running precompile or training run holds
    try:
        proc = cli("prune", "--cache-dir", str(cache), "--older-than", "30d")
        assert proc.returncode == 1 and "in use" in proc.stderr, proc.stderr
        assert old.exists()
        with pytest.raises(store.CacheInUse):
            maintenance.quarantine(cache,
                                   [maintenance.Finding("xla/67939951107342009493273238831484768838", "corrupt", "")])
    finally:
        use.release()
    assert cli("prune", "--cache-dir", str(cache), "--older-than", "30d").returncode == 0
    assert not old.exists()


@pytest.mark.slow
def test_prune_needs_a_criterion(cache):
    proc = cli("prune", "--cache-dir", str(cache))
    assert proc.returncode == 2 and "--older-than" in proc.stderr


# ----------------------------------------------------------------------------- pack / unpack


@pytest.mark.slow
def test_pack_unpack_round_trip(cache, tmp_path):
    archive = tmp_path / "warm.tar.gz"
    packed = cli("pack", "--cache-dir", str(cache), str(archive))
    assert packed.returncode == 0, packed.stderr
    assert "left out 3" in packed.stdout  # failed, locked and extracted-only entries stay behind
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert store.MANIFEST in names and not any(n.endswith(".lock") for n in names)
    assert f"{VERSION_DIR}/MODULE_02e0833b58066ea94f2c+2c2d707e/model.log" not in names

    other = tmp_path / "other-host"
    out = cli("unpack", "--cache-dir", str(other), str(archive))
    assert out.returncode == 0, out.stderr
    src, dst = store.load_manifest(cache), store.load_manifest(other)
    assert dst.configs.keys() == src.configs.keys()
    assert dst.files == src.files
    for rel in src.files:
        assert (other / rel).read_bytes() == (cache / rel).read_bytes()
    assert cli("verify", "--cache-dir", str(other)).returncode == 0
    again = cli("unpack", "--cache-dir", str(other), str(archive))  # identical files: nothing to do
    assert again.returncode == 0 and "unpacked 0 new files" in again.stdout


@pytest.mark.slow
def test_unpack_refuses_to_overwrite_a_different_entry(cache, tmp_path):
    archive = tmp_path / "warm.tar.gz"
    assert cli("pack", "--cache-dir", str(cache), str(archive)).returncode == 0
    other = tmp_path / "other"
    xla_entry(other, "67939951107342009493273238831484768838", size=99)  # same name, other bytes
    before = (other / "xla" / "67939951107342009493273238831484768838").read_bytes()
    # a torch_xla cache without our manifest is a cache only when the user says so (--adopt)
    proc = cli("unpack", "--cache-dir", str(other), str(archive), "--adopt")
    assert proc.returncode == 2 and "refusing to unpack" in proc.stderr and "differ" in proc.stderr
    assert (other / "xla" / "67939951107342009493273238831484768838").read_bytes() == before
    assert not (other / store.MANIFEST).exists() and not list(other.glob(VERSION_DIR))


@pytest.mark.slow
def test_pack_never_overwrites_and_refuses_a_damaged_cache(cache, tmp_path):
    archive = tmp_path / "warm.tar.gz"
    archive.write_text("precious")
    proc = cli("pack", "--cache-dir", str(cache), str(archive))
    assert proc.returncode == 2 and archive.read_text() == "precious"
    (cache / "xla" / "67939951107342009493273238831484768838").write_bytes(b"x")
    proc = cli("pack", "--cache-dir", str(cache), str(tmp_path / "new.tar.gz"))
    assert proc.returncode == 1 and "damaged" in proc.stderr and not (tmp_path / "new.tar.gz").exists()


@pytest.mark.slow
def test_unpack_rejects_a_tampered_archive(cache, tmp_path):
    good = tmp_path / "good.tar.gz"
    assert cli("pack", "--cache-dir", str(cache), str(good)).returncode == 0
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(good) as src, tarfile.open(bad, "w:gz") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if m.name.endswith("model.neff"):
                data = data[:50]
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    proc = cli("unpack", "--cache-dir", str(tmp_path / "dst"), str(bad))
    assert proc.returncode == 1 and "damaged" in proc.stderr
    assert not list((tmp_path / "dst").glob(VERSION_DIR))


@pytest.mark.slow
def test_s3_locations_are_checked_before_anything_runs(cache, tmp_path):
    with pytest.raises(UsageError, match="s3://BUCKET/KEY"):
        archive.split_s3("s3://bucket-only")
    env = cpu_env(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
                  AWS_EC2_METADATA_DISABLED="true")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "neuron_train", "cache", "pack", "--cache-dir", str(cache),
                           "s3://my-bucket/caches/warm.tar.gz"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2 and "no AWS credentials" in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------- list


@pytest.mark.slow
def test_cache_list_shows_size_entries_age_and_configurations(cache):
    proc = cli("list", "--cache-dir", str(cache))
    assert proc.returncode == 0, proc.stderr
    assert int(re.search(r"^entries\s+(\d+)", proc.stdout, re.M).group(1)) == 7
    assert "aaaaaaaaaaaaaaaa" in proc.stdout
    assert "vit-nano 32px, batch 32" in proc.stdout and "1 failed" in proc.stdout
    info = json.loads(cli("list", "--cache-dir", str(cache), "--json").stdout)
    assert info["configs"][0]["entries"] == 4 and info["unrecorded"] == 0
    on_disk = sum(f.stat().st_size for top in (cache / VERSION_DIR, cache / store.XLA_DIR)
                  for f in top.rglob("*") if f.is_file())
    assert info["bytes"] == on_disk  # every file of the 7 entries, counted here, not by the scan
    assert cli("list", "--cache-dir", str(cache / "nope")).returncode == 2


# ----------------------------------------------------------------------------- concurrency


def _writer(cache: str, who: int, rounds: int) -> None:
    for i in range(rounds):
        def add(m: Manifest, i: int = i) -> None:
            rec = m.configs.setdefault(f"config{who}", ConfigRecord(config={"who": who}))
            rec.graphs[f"g{i}"] = GraphRecord(phase="train", step=i)
            m.files[f"xla/{who}-{i}"] = FileRecord(sha256="0" * 64, size=i, recorded="t", recorded_by=f"config{who}")
        store.update_manifest(Path(cache), add)


@pytest.mark.slow  # four processes
def test_concurrent_manifest_updates_lose_nothing(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), who, 40)) for who in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    m = store.load_manifest(tmp_path)
    assert all(len(m.configs[f"config{w}"].graphs) == 40 for w in range(4))
    assert len(m.files) == 160
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # every write renamed into place
