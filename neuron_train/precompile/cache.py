"""The compile cache directory and `neuron-train cache list|verify|prune|pack|unpack`.

One directory (`compile_cache/` by default) holds three things:

- the Neuron persistent cache, written by the Neuron compiler wrapper when NEURON_CC_FLAGS has
  `--cache_dir=<this dir>`: `neuronxcc-<compiler version>/MODULE_<graph hash>+<flags hash>/` with
  `model.hlo_module.pb` (the extracted graph), `compile_flags.json`, `model.neff` + `model.done`
  (compiled), `model.log` without a NEFF (a compile that failed: it stays failed until retried),
  `*.lock` (a compile in progress, or left behind by an interrupted one);
- `xla/`: torch_xla's own persistent cache (`xr.initialize_cache`), one file per graph, used on
  devices other than Neuron. Its writer is not atomic and erases files it cannot load, so we never
  point it at `xla/` directly: a precompile writes into a private staging directory and
  `commit_staged` moves the files in, under the manifest lock;
- `manifest.json`: our graph manifest. `configs` maps a configuration fingerprint to the settings
  that determine its graphs and the graphs a precompile of it produced (precompile.py writes it);
  `files` holds the SHA-256 and size of every cache file we vouch for, so that a truncated or
  modified entry is found by `verify` and refused by a run instead of being loaded.

Concurrency: every change to the manifest is a read-merge-write under an exclusive fcntl lock,
written to a temporary file and renamed over the old one. Precompiles and runs hold a shared
"use" lock for their whole duration; `prune` and `verify --quarantine` need it exclusively and
refuse while anyone uses the cache. fcntl locks are only as good as the file system's locking:
on NFS/EFS/FSx several hosts may not see each other's locks (hence: one cache per host).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TypeVar

from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.fileio import write_json_atomic

DEFAULT_CACHE_DIR = "compile_cache"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "neuron-train-graph-manifest"
MANIFEST_VERSION = 1
MANIFEST_LOCK = ".neuron_train.manifest.lock"
USE_LOCK = ".neuron_train.use.lock"
XLA_DIR = "xla"
STAGING_DIR = ".staging"
QUARANTINE_DIR = "quarantine"
NEURON_VERSION_GLOB = "neuronxcc-*"
NEURON_MODULE_GLOB = "MODULE_*"
SIZE_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# Entry states. xla files have no state of their own; Neuron entries go extracted -> compiled/failed.
COMPILED, FAILED, LOCKED, INCOMPLETE, FILE = "compiled", "failed", "locked", "incomplete", "file"
# verify findings that make the cache unsafe to use (exit 1); the others are information.
BAD_FINDINGS = ("corrupt", "missing", FAILED)

T = TypeVar("T")


class CacheInUse(RunError):
    """Another process holds a lock this operation needs."""


# ----------------------------------------------------------------------------- locks


@contextmanager
def file_lock(path: Path, *, shared: bool = False, wait: bool = True, purpose: str = "") -> Iterator[None]:
    """An fcntl (flock) lock on `path`, released when the block ends (or the process dies)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            raise CacheInUse(f"{path.parent} is in use by a running precompile or training run "
                             f"(lock {path.name} is held){': ' + purpose if purpose else ''}; "
                             "try again when it has finished") from None
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


class CacheUse:
    """A shared 'in use' lock held for a whole precompile or run: prune waits for it to end."""

    def __init__(self, cache: Path):
        self._ctx = file_lock(Path(cache) / USE_LOCK, shared=True)
        self._ctx.__enter__()

    def release(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None


# ----------------------------------------------------------------------------- manifest


def empty_manifest() -> dict:
    return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "configs": {}, "files": {}}


def load_manifest(cache: Path) -> dict:
    """The cache's manifest (an empty one when there is none yet)."""
    path = Path(cache) / MANIFEST
    if not path.exists():
        return empty_manifest()
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunError(f"{path} is damaged ({exc}): move it aside and precompile again") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise RunError(f"{path} is not a neuron-train graph manifest: move it aside or choose "
                       "another cache directory")
    if data.get("version") != MANIFEST_VERSION:
        raise RunError(f"{path} has manifest version {data.get('version')}, this neuron-train "
                       f"reads version {MANIFEST_VERSION}: precompile into a new cache directory")
    data.setdefault("configs", {})
    data.setdefault("files", {})
    return data


def update_manifest(cache: Path, change: Callable[[dict], T]) -> T:
    """Read, change and rewrite the manifest under the exclusive manifest lock (atomic rename)."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    with file_lock(cache / MANIFEST_LOCK):
        manifest = load_manifest(cache)
        result = change(manifest)
        write_json_atomic(cache / MANIFEST, manifest)
    return result


def merge_manifest(into: dict, other: dict) -> None:
    """Union of two manifests: configs' graphs and precompile ids merge; file records are added."""
    for fp, record in other.get("configs", {}).items():
        mine = into["configs"].setdefault(fp, {**record, "graphs": {}, "precompile_ids": []})
        for h, graph in record.get("graphs", {}).items():
            mine["graphs"].setdefault(h, graph)
        mine["precompile_ids"] = sorted(set(mine.get("precompile_ids", []))
                                        | set(record.get("precompile_ids", [])))
        mine["updated"] = max(mine.get("updated", ""), record.get("updated", ""))
    for rel, rec in other.get("files", {}).items():
        into["files"].setdefault(rel, rec)


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ----------------------------------------------------------------------------- entries


@dataclass(frozen=True)
class Entry:
    """One cached graph: an xla/ file or a Neuron MODULE_ directory."""

    path: str                  # relative to the cache directory, '/'-separated
    state: str                 # FILE (an xla/ file), or for Neuron: COMPILED / FAILED / LOCKED / INCOMPLETE
    files: tuple[str, ...]     # relative paths of the files we checksum (lock files excluded)
    size: int
    mtime: float               # newest file modification time


def neuron_state(module_dir: Path) -> str:
    """The state of a Neuron cache entry, from the marker files the compiler wrapper leaves."""
    names = {p.name for p in module_dir.iterdir()}
    if "model.neff" in names and "model.done" in names:
        return COMPILED
    if "model.log" in names and "model.neff" not in names:
        return FAILED
    if any(n.endswith(".lock") for n in names):
        return LOCKED
    return INCOMPLETE


def _entry(cache: Path, path: Path, state: str, files: list[Path]) -> Entry:
    stats = [f.stat() for f in files]
    return Entry(path=path.relative_to(cache).as_posix(), state=state,
                 files=tuple(f.relative_to(cache).as_posix() for f in files if not f.name.endswith(".lock")),
                 size=sum(s.st_size for s in stats),
                 mtime=max((s.st_mtime for s in stats), default=path.stat().st_mtime))


def scan(cache: Path) -> list[Entry]:
    """Every graph entry in the cache directory (Neuron and torch_xla layouts)."""
    cache = Path(cache)
    entries: list[Entry] = []
    xla = cache / XLA_DIR
    if xla.is_dir():
        entries += [_entry(cache, f, FILE, [f]) for f in sorted(xla.iterdir()) if f.is_file()]
    for version_dir in sorted(cache.glob(NEURON_VERSION_GLOB)):
        for module in sorted(version_dir.glob(NEURON_MODULE_GLOB)):
            if module.is_dir():
                files = sorted(p for p in module.rglob("*") if p.is_file())
                entries.append(_entry(cache, module, neuron_state(module), files))
    return entries


def entry_of(rel: str) -> str:
    """The entry a cache file belongs to: the xla/ file itself, or its MODULE_ directory."""
    parts = PurePosixPath(rel).parts
    return "/".join(parts[:2])


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_record(path: Path, recorded_by: str) -> dict:
    return {"sha256": sha256_file(path), "size": path.stat().st_size, "recorded": utc_now(),
            "recorded_by": recorded_by}


def recordable(entry: Entry) -> bool:
    """Only finished, successful entries are vouched for (a failed one may be retried later)."""
    return entry.state in (FILE, COMPILED)


def record_entries(cache: Path, recorded_by: str) -> list[str]:
    """Checksum every finished entry the manifest does not know yet; returns their paths.

    Run after neuron_parallel_compile has compiled: entries another process is still writing
    are locked or incomplete and are left for whoever finishes them.
    """
    cache = Path(cache)

    def add(manifest: dict) -> list[str]:
        added = []
        for entry in scan(cache):
            new = [f for f in entry.files if f not in manifest["files"]]
            if recordable(entry) and new:
                for rel in new:
                    manifest["files"][rel] = file_record(cache / rel, recorded_by)
                added.append(entry.path)
        return added

    return update_manifest(cache, add)


def commit_staged(cache: Path, staging: Path, recorded_by: str) -> int:
    """Move torch_xla cache files from a private staging directory into xla/, recording them.

    A file whose name is already in xla/ is dropped: it is the same graph (CPU serialisation is
    not byte-for-byte reproducible, so the first committed copy is the one we vouch for).
    """
    cache, staging = Path(cache), Path(staging)
    target = cache / XLA_DIR
    target.mkdir(parents=True, exist_ok=True)

    def commit(manifest: dict) -> int:
        moved = 0
        for f in sorted(p for p in staging.iterdir() if p.is_file()) if staging.is_dir() else []:
            dest = target / f.name
            if dest.exists():
                f.unlink()
                continue
            os.replace(f, dest)  # same file system: atomic
            manifest["files"][dest.relative_to(cache).as_posix()] = file_record(dest, recorded_by)
            moved += 1
        return moved

    moved = update_manifest(cache, commit)
    shutil.rmtree(staging, ignore_errors=True)
    return moved


# ----------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class Finding:
    entry: str     # the entry's relative path
    problem: str   # corrupt / missing / failed / locked / incomplete / unrecorded
    detail: str


def _failed_reason(cache: Path, entry: Entry) -> str:
    log = cache / entry.path / "model.log"
    try:
        text = log.read_text(errors="replace").strip()
    except OSError:
        return "compile failed"
    first = text.splitlines()[0] if text else "compile failed"
    if first.startswith("Failed compilation with [") and "]: " in first:
        # The wrapper's line is the full neuronx-cc command, then the compiler's message: keep that.
        first = "neuronx-cc: " + first.split("]: ", 1)[1]
    return first[:200] + ("..." if len(first) > 200 else "")


def check_files(cache: Path, files: dict[str, dict]) -> list[Finding]:
    """Compare recorded files with the disk: missing, truncated or modified ones."""
    findings = []
    for rel, rec in sorted(files.items()):
        path, entry = Path(cache) / rel, entry_of(rel)
        name = f"{rel[len(entry) + 1:]}: " if rel != entry else ""  # the file within a Neuron entry
        if not path.is_file():
            findings.append(Finding(entry, "missing", f"{name}recorded but gone"))
            continue
        size = path.stat().st_size
        if size != rec["size"]:
            findings.append(Finding(entry, "corrupt", f"{name}{size} bytes, {rec['size']} when recorded "
                                                      "(truncated or rewritten)"))
        elif sha256_file(path) != rec["sha256"]:
            findings.append(Finding(entry, "corrupt", f"{name}checksum differs from the manifest "
                                                      "(modified after it was recorded)"))
    return findings


def verify(cache: Path, manifest: dict | None = None) -> list[Finding]:
    """All problems of a cache: damaged or missing recorded files, failed compiles, leftovers."""
    cache = Path(cache)
    manifest = manifest if manifest is not None else load_manifest(cache)
    findings = check_files(cache, manifest["files"])
    for entry in scan(cache):
        if entry.state == FAILED:
            findings.append(Finding(entry.path, FAILED, _failed_reason(cache, entry)))
        elif entry.state == LOCKED:
            findings.append(Finding(entry.path, LOCKED, "a compile is running, or was interrupted "
                                                        "(neuron_parallel_compile --command clear-locks)"))
        elif entry.state == INCOMPLETE:
            findings.append(Finding(entry.path, INCOMPLETE, "graph extracted but never compiled"))
        elif not any(f in manifest["files"] for f in entry.files):
            findings.append(Finding(entry.path, "unrecorded", "not in the manifest (compiled by a "
                                                              "run, not by precompile)"))
    return findings


def quarantine(cache: Path, findings: list[Finding]) -> Path | None:
    """Move corrupt entries aside (never deleted) and forget records of missing files.

    Needs the cache to itself: a running process could be loading the entry being moved.
    """
    cache = Path(cache)
    corrupt = sorted({f.entry for f in findings if f.problem == "corrupt"})
    bad = {f.entry for f in findings if f.problem in ("corrupt", "missing")}
    if not bad:
        return None
    dest_root = cache / QUARANTINE_DIR / time.strftime("%Y%m%d-%H%M%S")
    with file_lock(cache / USE_LOCK, wait=False, purpose="quarantine needs the cache to itself"):
        for rel in corrupt:
            dest = dest_root / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(cache / rel, dest)

        update_manifest(cache, lambda manifest: forget_entries(manifest, bad))
    return dest_root if corrupt else None


def forget_entries(manifest: dict, gone: set[str]) -> None:
    """Drop the records of removed entries; their configurations remember how many files they lost."""
    lost: dict[str, int] = {}
    for rel in [r for r in manifest["files"] if entry_of(r) in gone]:
        by = manifest["files"].pop(rel).get("recorded_by", "")
        lost[by] = lost.get(by, 0) + 1
    for fp, n in lost.items():
        if fp in manifest["configs"]:
            record = manifest["configs"][fp]
            record["pruned_files"] = record.get("pruned_files", 0) + n
            record["pruned_at"] = utc_now()


# ----------------------------------------------------------------------------- prune


def parse_size(text: str) -> int:
    """'50G', '500M', '1.5T', '123' (bytes) -> bytes (binary units)."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in SIZE_UNITS else ""
    number = raw[: len(raw) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        raise UsageError(f"--max-size: expected a size like 500M, 20G or 1T, got {text!r}") from None
    if value < 0:
        raise UsageError(f"--max-size must be >= 0, got {text!r}")
    return int(value * SIZE_UNITS[unit])


def parse_age(text: str) -> float:
    """'30d', '12h', '90m', '2w', '45s' -> seconds."""
    raw = text.strip().lower()
    unit, number = raw[-1:], raw[:-1]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in AGE_UNITS or value < 0:
        raise UsageError(f"--older-than: expected an age like 30d, 12h, 90m or 2w, got {text!r}")
    return value * AGE_UNITS[unit]


def select_prune(entries: list[Entry], *, now: float, older_than: float | None = None,
                 max_size: int | None = None, failed: bool = False) -> list[Entry]:
    """The entries to delete, oldest first. Locked entries (a compile in progress) are never chosen."""
    candidates = sorted((e for e in entries if e.state != LOCKED), key=lambda e: e.mtime)
    chosen = [e for e in candidates
              if (older_than is not None and now - e.mtime > older_than) or (failed and e.state == FAILED)]
    if max_size is not None:
        total = sum(e.size for e in entries) - sum(e.size for e in chosen)
        for e in candidates:
            if total <= max_size:
                break
            if e not in chosen:
                chosen.append(e)
                total -= e.size
    return sorted(chosen, key=lambda e: e.mtime)


def prune(cache: Path, chosen: list[Entry]) -> None:
    """Delete entries and their records; configurations that lose entries are marked as pruned."""
    cache = Path(cache)
    gone = {e.path for e in chosen}
    with file_lock(cache / USE_LOCK, wait=False, purpose="prune needs the cache to itself"):
        for e in chosen:
            target = cache / e.path
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)

        update_manifest(cache, lambda manifest: forget_entries(manifest, gone))


# ----------------------------------------------------------------------------- pack / unpack


def is_s3(location: str) -> bool:
    return location.startswith("s3://")


def split_s3(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("s3://"):].partition("/")
    if not bucket or not key or key.endswith("/"):
        raise UsageError(f"expected s3://BUCKET/KEY (a file name, not a prefix), got {url!r}")
    return bucket, key


def _s3_client(url: str):
    try:
        import boto3
    except ImportError:
        raise UsageError(f"{url}: S3 needs boto3 (pip install boto3)") from None
    session = boto3.session.Session()
    if session.get_credentials() is None:
        raise UsageError(f"{url}: no AWS credentials found (instance role, AWS_PROFILE or "
                         "`aws configure`); or pack to a local file and copy it yourself")
    return session.client("s3")


def _s3_exists(client, bucket: str, key: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        client.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise RunError(f"s3://{bucket}/{key}: {exc}") from None
    return True


def packable(entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
    """(entries to pack, entries left out): failed, locked and unfinished ones stay behind."""
    keep = [e for e in entries if recordable(e)]
    return keep, [e for e in entries if not recordable(e)]


def pack(cache: Path, dest: str) -> dict:
    """Write the cache's finished entries and their manifest into one .tar.gz (or s3:// object)."""
    cache = Path(cache)
    if not cache.is_dir():
        raise UsageError(f"no such cache directory: {cache}")
    if not is_s3(dest) and Path(dest).exists():
        raise UsageError(f"{dest} already exists: choose another file name (nothing is overwritten)")
    client = None
    if is_s3(dest):
        bucket, key = split_s3(dest)
        client = _s3_client(dest)
        if _s3_exists(client, bucket, key):
            raise UsageError(f"{dest} already exists: choose another key (nothing is overwritten)")
    with file_lock(cache / USE_LOCK, shared=True), \
            tempfile.TemporaryDirectory(dir=cache, prefix=f"{STAGING_DIR}-pack-") as tmp:
        manifest = load_manifest(cache)
        bad = [f for f in check_files(cache, manifest["files"]) if f.problem == "corrupt"]
        if bad:
            raise RunError(f"refusing to pack a damaged cache ({len(bad)} damaged file(s), e.g. "
                           f"{bad[0].entry}: {bad[0].detail}): run `neuron-train cache verify --quarantine` first")
        keep, left = packable(scan(cache))
        packed = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                  "configs": manifest["configs"], "files": {}}
        for entry in keep:
            for rel in entry.files:
                packed["files"][rel] = manifest["files"].get(rel) or file_record(cache / rel, "pack")
        archive = Path(tmp) / "cache.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            info = tarfile.TarInfo(MANIFEST)
            payload = json.dumps(packed, indent=2).encode()
            info.size, info.mtime = len(payload), int(time.time())
            tar.addfile(info, io.BytesIO(payload))
            for rel in sorted(packed["files"]):
                tar.add(cache / rel, arcname=rel, recursive=False)
        if client is not None:
            client.upload_file(str(archive), *split_s3(dest))
        else:
            _move_new(archive, Path(dest))
    return {"entries": len(keep), "files": len(packed["files"]), "left_out": [e.path for e in left],
            "bytes": sum(e.size for e in keep)}


def _move_new(src: Path, dest: Path) -> None:
    """Move `src` to `dest` without ever replacing an existing `dest` (link, then unlink)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)  # fails if dest appeared meanwhile: never overwrite
    except FileExistsError:
        raise UsageError(f"{dest} already exists: choose another file name (nothing is overwritten)") from None
    except OSError:  # another file system, or no hard links: copy beside, then rename
        part = dest.with_name(f".{dest.name}.part-{os.getpid()}")
        shutil.copyfile(src, part)
        if dest.exists():
            part.unlink()
            raise UsageError(f"{dest} already exists: choose another file name") from None
        os.replace(part, dest)
    src.unlink(missing_ok=True)


def _safe_member(member: tarfile.TarInfo) -> str:
    rel = PurePosixPath(member.name)
    if rel.is_absolute() or ".." in rel.parts or not (member.isfile() or member.isdir()):
        raise RunError(f"archive member {member.name!r} is not a plain relative file: refusing to unpack")
    return rel.as_posix()


def unpack(source: str, cache: Path) -> dict:
    """Add an archive's entries to a cache: verified first, nothing existing is overwritten."""
    cache = Path(cache)
    if not is_s3(source) and not Path(source).is_file():
        raise UsageError(f"no such archive: {source}")
    cache.mkdir(parents=True, exist_ok=True)
    with file_lock(cache / USE_LOCK, shared=True), \
            tempfile.TemporaryDirectory(dir=cache, prefix=f"{STAGING_DIR}-unpack-") as tmp:
        staging = Path(tmp)
        archive = Path(source)
        if is_s3(source):
            archive = staging / "download.tar.gz"
            _s3_client(source).download_file(*split_s3(source), str(archive))
        incoming = _extract_verified(archive, staging / "files")

        def merge(manifest: dict) -> list[str]:
            # Checked under the manifest lock, so no committer can slip a file in between.
            new = [rel for rel in sorted(incoming["files"]) if not (cache / rel).exists()]
            conflicts = [rel for rel, rec in sorted(incoming["files"].items())
                         if rel not in new and sha256_file(cache / rel) != rec["sha256"]]
            if conflicts:
                raise UsageError(f"refusing to unpack: {len(conflicts)} file(s) already in {cache} "
                                 f"differ from the archive (e.g. {conflicts[0]}); unpack into an empty "
                                 "directory or prune those entries first")
            for rel in new:
                target = cache / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging / "files" / rel, target)
            merge_manifest(manifest, incoming)
            return new

        new = update_manifest(cache, merge)
    return {"new_files": len(new), "identical": len(incoming["files"]) - len(new),
            "configs": len(incoming["configs"])}


def _extract_verified(archive: Path, into: Path) -> dict:
    """Extract an archive into a private directory and check every file against its manifest."""
    try:
        tar = tarfile.open(archive, "r:*")
    except (tarfile.TarError, OSError) as exc:
        raise RunError(f"{archive} is not a readable .tar.gz archive: {exc}") from None
    with tar:
        try:
            members = {_safe_member(m): m for m in tar.getmembers()}
            if MANIFEST not in members:
                raise RunError(f"{archive} has no {MANIFEST}: not made by `neuron-train cache pack`")
            incoming = json.loads(tar.extractfile(members[MANIFEST]).read())
            if not isinstance(incoming, dict) or incoming.get("format") != MANIFEST_FORMAT:
                raise RunError(f"{archive}: its {MANIFEST} is not a neuron-train graph manifest")
            for rel, member in members.items():
                if member.isdir() or rel == MANIFEST:
                    continue
                if rel not in incoming["files"]:
                    raise RunError(f"{archive}: member {rel} is not listed in its manifest")
                tar.extract(member, into, filter="data")
        except (tarfile.TarError, EOFError, OSError, json.JSONDecodeError) as exc:
            raise RunError(f"{archive} is damaged: {exc}") from None
    missing = [rel for rel in incoming["files"] if not (into / rel).is_file()]
    if missing:
        raise RunError(f"{archive} is incomplete: {missing[0]} is listed but absent")
    damaged = check_files(into, incoming["files"])
    if damaged:
        raise RunError(f"{archive} is damaged: {damaged[0].entry}: {damaged[0].detail}")
    return incoming


# ----------------------------------------------------------------------------- list


def state_word(state: str) -> str:
    return "torch_xla" if state == FILE else state


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def describe_config(config: dict) -> str:
    """One line naming the settings that matter most to a reader of `cache list`."""
    parts = [f"{config.get('model')} {config.get('img_size')}px", f"batch {config.get('batch_size')}"]
    if config.get("grad_accum", 1) != 1:
        parts.append(f"accum {config['grad_accum']}")
    parts += [str(config.get("precision")), f"world {config.get('world_size')}", str(config.get("device"))]
    return ", ".join(parts)


def cache_listing(cache: Path, now: float | None = None) -> dict:
    """What `cache list` shows, as data."""
    cache = Path(cache)
    now = time.time() if now is None else now
    manifest = load_manifest(cache)
    entries = scan(cache)
    by_config: dict[str, list[Entry]] = {}
    for e in entries:
        owners = {manifest["files"][f].get("recorded_by") for f in e.files if f in manifest["files"]}
        for fp in owners:
            by_config.setdefault(fp, []).append(e)
    states: dict[str, int] = {}
    for e in entries:
        states[e.state] = states.get(e.state, 0) + 1
    configs = []
    for fp, record in sorted(manifest["configs"].items(), key=lambda kv: kv[1].get("updated", "")):
        mine = by_config.get(fp, [])
        configs.append({"fingerprint": fp, "summary": describe_config(record["config"]),
                        "graphs": len(record.get("graphs", {})), "entries": len(mine),
                        "bytes": sum(e.size for e in mine), "updated": record.get("updated"),
                        "host": record.get("host"), "pruned_files": record.get("pruned_files", 0)})
    return {"cache_dir": str(cache.absolute()), "entries": len(entries), "bytes": sum(e.size for e in entries),
            "states": states, "oldest_age_s": now - min((e.mtime for e in entries), default=now),
            "newest_age_s": now - max((e.mtime for e in entries), default=now),
            "configs": configs,
            "unrecorded": sum(1 for e in entries if recordable(e) and not any(f in manifest["files"] for f in e.files))}


def format_listing(info: dict) -> str:
    lines = [f"cache      {info['cache_dir']}",
             f"entries    {info['entries']} ({human_size(info['bytes'])})"
             + (": " + ", ".join(f"{n} {state_word(s)}" for s, n in sorted(info["states"].items()))
                if info["states"] else ""),
             ]
    if info["entries"]:
        lines.append(f"age        newest {human_age(info['newest_age_s'])}, oldest {human_age(info['oldest_age_s'])}")
    lines.append(f"configs    {len(info['configs'])} precompiled configuration(s)"
                 + (f"; {info['unrecorded']} entries not from a precompile" if info["unrecorded"] else ""))
    for c in info["configs"]:
        pruned = f", {c['pruned_files']} files pruned" if c["pruned_files"] else ""
        lines.append(f"  {c['fingerprint']}  {c['summary']}: {c['graphs']} graphs, {c['entries']} entries "
                     f"({human_size(c['bytes'])}), updated {c['updated']} on {c['host']}{pruned}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command


def configure_parser(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, metavar="DIR",
                        help=f"the compile cache directory (default: {DEFAULT_CACHE_DIR})")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("list", parents=[common], help="size, entries, age and configurations")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p = sub.add_parser("verify", parents=[common], help="check entries against the manifest's checksums "
                       "and report failed compiles (exit 1 when the cache is unsafe)")
    p.add_argument("--quarantine", action="store_true", help="move damaged entries to "
                   f"{QUARANTINE_DIR}/<time>/ (never deleted) and forget missing ones")
    p = sub.add_parser("prune", parents=[common], help="delete entries by age or total size "
                       "(refused while a precompile or run uses the cache)")
    p.add_argument("--older-than", metavar="AGE", help="delete entries not written for AGE (30d, 12h, 2w)")
    p.add_argument("--max-size", metavar="SIZE", help="delete oldest entries until the cache fits in "
                   "SIZE (500M, 20G)")
    p.add_argument("--failed", action="store_true", help="delete entries cached as failed compiles "
                   "(they are otherwise never retried)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    p = sub.add_parser("pack", parents=[common], help="write finished entries and the manifest into "
                       "one .tar.gz, locally or to s3://BUCKET/KEY")
    p.add_argument("archive", metavar="FILE", help="FILE.tar.gz or s3://BUCKET/KEY (never overwritten)")
    p = sub.add_parser("unpack", parents=[common], help="add an archive's entries to the cache "
                       "(refuses entries that exist and differ)")
    p.add_argument("archive", metavar="FILE", help="FILE.tar.gz or s3://BUCKET/KEY")


def _existing(cache_dir: str) -> Path:
    cache = Path(cache_dir)
    if is_s3(cache_dir):
        raise UsageError("--cache-dir must be a local directory; move caches to and from S3 with "
                         "`cache pack s3://...` and `cache unpack s3://...`")
    if not cache.is_dir():
        raise UsageError(f"no such cache directory: {cache_dir}")
    return cache


def _cmd_list(args: argparse.Namespace) -> int:
    info = cache_listing(_existing(args.cache_dir))
    print(json.dumps(info, indent=2) if args.json else format_listing(info))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    cache = _existing(args.cache_dir)
    manifest = load_manifest(cache)
    findings = verify(cache, manifest)
    for f in findings:
        print(f"{f.problem:<11} {f.entry}: {f.detail}")
    bad = [f for f in findings if f.problem in BAD_FINDINGS]
    print(f"{len(manifest['files'])} recorded files checked, {len(scan(cache))} entries: "
          + (f"{len(bad)} problem(s)" if bad else "OK"))
    if args.quarantine:
        moved_to = quarantine(cache, findings)
        if moved_to:
            print(f"moved damaged entries to {moved_to}; precompile again to rebuild them")
        bad = [f for f in bad if f.problem == FAILED]
    if any(f.problem == FAILED for f in bad):
        print("failed compiles stay failed: precompile with --retry-failed, or `neuron-train cache prune "
              "--failed`")
    return 1 if bad else 0


def _cmd_prune(args: argparse.Namespace) -> int:
    cache = _existing(args.cache_dir)
    if not (args.older_than or args.max_size or args.failed):
        raise UsageError("say what to prune: --older-than AGE, --max-size SIZE and/or --failed")
    older = parse_age(args.older_than) if args.older_than else None
    max_size = parse_size(args.max_size) if args.max_size else None
    entries = scan(cache)
    chosen = select_prune(entries, now=time.time(), older_than=older, max_size=max_size, failed=args.failed)
    locked = [e for e in entries if e.state == LOCKED]
    for e in chosen:
        print(f"{'would delete' if args.dry_run else 'delete'} {e.path} ({human_size(e.size)}, "
              f"{human_age(time.time() - e.mtime)} old, {state_word(e.state)})")
    if locked:
        print(f"kept {len(locked)} locked entr{'y' if len(locked) == 1 else 'ies'} (compile in progress)")
    if not args.dry_run and chosen:
        prune(cache, chosen)
    freed = sum(e.size for e in chosen)
    print(f"{'would free' if args.dry_run else 'freed'} {human_size(freed)} in {len(chosen)} entries; "
          f"{human_size(sum(e.size for e in entries) - freed)} left")
    return 0


def _cmd_pack(args: argparse.Namespace) -> int:
    result = pack(_existing(args.cache_dir), args.archive)
    print(f"packed {result['entries']} entries ({result['files']} files, {human_size(result['bytes'])}) "
          f"into {args.archive}")
    if result["left_out"]:
        print(f"left out {len(result['left_out'])} failed/locked/unfinished entries, e.g. {result['left_out'][0]}")
    return 0


def _cmd_unpack(args: argparse.Namespace) -> int:
    if is_s3(args.cache_dir):
        raise UsageError("--cache-dir must be a local directory")
    result = unpack(args.archive, Path(args.cache_dir))
    print(f"unpacked {result['new_files']} new files into {args.cache_dir} ({result['identical']} already "
          f"present and identical, {result['configs']} configuration(s) merged into the manifest)")
    return 0


def main(args: argparse.Namespace) -> int:
    actions = {"list": _cmd_list, "verify": _cmd_verify, "prune": _cmd_prune, "pack": _cmd_pack,
               "unpack": _cmd_unpack}
    return actions[args.action](args)

