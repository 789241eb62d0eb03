"""The compile cache directory: its layout, locks, graph manifest and entries.

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
- `manifest.json`: our graph manifest (typed records in manifest.py). `configs` maps a configuration
  fingerprint to the settings that determine its graphs and the graphs a precompile of it produced
  (the hook writes it); `files` holds the SHA-256 and size of every cache file we vouch for, so that
  a truncated or modified entry is found by `verify` and refused by a run instead of being loaded.

Concurrency: every change to the manifest is a read-merge-write under an exclusive fcntl lock,
written to a temporary file and renamed over the old one. Precompiles and runs hold a shared
"use" lock for their whole duration; `prune` and `verify --quarantine` need it exclusively and
refuse while anyone uses the cache. fcntl locks are only as good as the file system's locking:
on NFS/EFS/FSx several hosts may not see each other's locks (hence: one cache per host).

Maintenance (verify, quarantine, prune) is in `maintenance.py`, archives in `archive.py`, the
`neuron-train cache` command in commands/cache.py.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from neuron_train.common import reader, writer
from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.fileio import confined, is_s3, sha256_file, write_json_atomic
from neuron_train.precompile.manifest import (
    NEURON_MODULE_PREFIX,
    NEURON_VERSION_PREFIX,
    XLA_DIR,
    FileRecord,
    Manifest,
    ManifestError,
)

DEFAULT_CACHE_DIR = "compile_cache"
MANIFEST = "manifest.json"
MANIFEST_LOCK = ".neuron_train.manifest.lock"
USE_LOCK = ".neuron_train.use.lock"
STAGING_DIR = ".staging"
PRUNE_MARK = "prune"  # `.prune.running-HOST-PID` while a prune deletes (fileio.work_path): a killed one leaves it
MANIFEST_LIMIT = 256 * 2**20  # ~250 bytes a file: a million cache files
# What the Neuron compiler wrapper writes into a MODULE_ folder: prune deletes only these (and
# files the manifest records), never a file it cannot vouch for. Lock files end in ".lock".
NEURON_ARTIFACTS = frozenset({"model.hlo_module.pb", "compile_flags.json", "model.neff", "model.done",
                              "model.log"})
ADOPT_FLAG = "--adopt"
# Entry states. xla files have no state of their own; Neuron entries go extracted -> compiled/failed.
COMPILED, FAILED, LOCKED, INCOMPLETE, FILE = "compiled", "failed", "locked", "incomplete", "file"

T = TypeVar("T")


class CacheInUse(RunError):
    """Another process holds a lock this operation needs."""


def open_cache(location: str) -> Path:
    """The one door to a compile-cache folder: every command that opens one (train and the loop's cache
    hook, precompile, check-graphs, cache) takes its --compile-cache through here. The compiler reads
    and writes the cache in place, so it is a local folder: an S3 URL is refused, naming the command
    that brings an S3 archive into one (`cache pack` takes a folder there)."""
    if is_s3(location):
        raise UsageError(f"--compile-cache must be a local folder, not {location}: bring an S3 archive into "
                         "one with `neuron-train cache unpack s3://BUCKET/KEY --compile-cache DIR`")
    return Path(location)


# ----------------------------------------------------------------------------- locks


@contextmanager
def file_lock(path: Path, *, shared: bool = False, wait: bool = True, purpose: str = "") -> Iterator[None]:
    """An fcntl (flock) lock on `path`, released when the block ends (or the process dies)."""
    fd, _ = writer.open_lock(path, "cache's lock file")  # never through a link (a dangling one: outside the cache)
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
        ctx = file_lock(Path(cache) / USE_LOCK, shared=True)
        ctx.__enter__()
        self._ctx: AbstractContextManager[None] | None = ctx

    def release(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None


# ----------------------------------------------------------------------------- manifest


def load_manifest(cache: Path) -> Manifest:
    """The cache's manifest (an empty one when there is none yet); `RunError` if it is damaged."""
    path = Path(cache) / MANIFEST
    if not path.exists() and not path.is_symlink():
        return Manifest()
    try:  # unreadable (permissions) is not damaged: the advice below would lose a good manifest
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
    except OSError as exc:
        raise RunError(f"{path}: the cache's manifest cannot be read ({exc.strerror or exc}): fix its "
                       "permissions, or use the cache as a user who may read it; nothing was changed") from None
    try:
        data = reader.load(path, fmt="json", limit=MANIFEST_LIMIT)
    except UsageError as exc:  # not a regular file, too large, not JSON, nested too deeply
        raise RunError(f"{exc}: the cache's manifest is damaged; move it aside and precompile again") from None
    try:
        return Manifest.from_json(data, str(path))
    except ManifestError as exc:
        raise ManifestError(f"{exc}: the cache's manifest is damaged or was not written by neuron-train; "
                            "move it aside (the cache's files are kept) and precompile again") from None


def has_manifest(cache: Path) -> bool:
    path = Path(cache) / MANIFEST
    return path.exists() or path.is_symlink()  # anything by that name is read (and refused unless ours)


def is_compiler_artifact(name: str) -> bool:
    return name in NEURON_ARTIFACTS or name.endswith(".lock")


def _own_file(name: str) -> bool:
    """Files our cache commands make in any cache: locks, staging folders."""
    return name in (USE_LOCK, MANIFEST_LOCK) or name.startswith((STAGING_DIR, f".{PRUNE_MARK}.running-"))


def has_neuron_layout(cache: Path) -> bool:
    return any(m.is_dir() for v in Path(cache).glob(f"{NEURON_VERSION_PREFIX}*")
               for m in v.glob(f"{NEURON_MODULE_PREFIX}*"))


def require_cache(cache: Path, action: str, adopt: bool = False) -> None:
    """Refuse to change a folder that is not a compile cache, unless the user opted in (--adopt).

    A cache is ours (it has our manifest: read here, so a foreign or damaged one is refused too),
    the Neuron compiler's (neuronxcc-*/MODULE_* folders), missing, or empty but for our own files."""
    cache = Path(cache)
    if adopt or not cache.is_dir():
        return
    if has_manifest(cache):
        load_manifest(cache)  # raises one line if it is not our manifest
        return
    if has_neuron_layout(cache) or all(_own_file(p.name) for p in cache.iterdir()):
        return
    raise UsageError(f"{cache} is not a compile cache (no {MANIFEST}, no {NEURON_VERSION_PREFIX}*/"
                     f"{NEURON_MODULE_PREFIX}* folders): `cache {action}` changes nothing in it; check "
                     f"--cache-dir, or pass {ADOPT_FLAG} if it really is one")


def update_manifest(cache: Path, change: Callable[[Manifest], T]) -> T:
    """Read, change and rewrite the manifest under the exclusive manifest lock (atomic rename)."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    with file_lock(cache / MANIFEST_LOCK):
        manifest = load_manifest(cache)
        result = change(manifest)
        write_json_atomic(cache / MANIFEST, manifest.to_json())
    return result


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def cache_path(cache: Path, rel: str) -> Path:
    """`cache / rel` for a path read from a manifest or an archive, refused unless it stays inside."""
    try:
        return confined(Path(cache), rel, f"compile cache {cache}")
    except UsageError as exc:
        raise RunError(f"{exc} (a damaged or crafted manifest?)") from None


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
    for version_dir in sorted(cache.glob(f"{NEURON_VERSION_PREFIX}*")):
        for module in sorted(version_dir.glob(f"{NEURON_MODULE_PREFIX}*")):
            if module.is_dir():
                files = sorted(p for p in module.rglob("*") if p.is_file())
                entries.append(_entry(cache, module, neuron_state(module), files))
    return entries


def file_record(path: Path, recorded_by: str) -> FileRecord:
    return FileRecord(sha256=sha256_file(path), size=path.stat().st_size, recorded=utc_now(),
                      recorded_by=recorded_by)


def recordable(entry: Entry) -> bool:
    """Only finished, successful entries are vouched for (a failed one may be retried later)."""
    return entry.state in (FILE, COMPILED)


def record_entries(cache: Path, recorded_by: str) -> list[str]:
    """Checksum every finished entry the manifest does not know yet; returns their paths.

    Run after neuron_parallel_compile has compiled: entries another process is still writing
    are locked or incomplete and are left for whoever finishes them.
    """
    cache = Path(cache)

    def add(manifest: Manifest) -> list[str]:
        added = []
        for entry in scan(cache):
            new = [f for f in entry.files if f not in manifest.files]
            if recordable(entry) and new:
                for rel in new:
                    manifest.files[rel] = file_record(cache / rel, recorded_by)
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

    def commit(manifest: Manifest) -> int:
        moved = 0
        for f in sorted(p for p in staging.iterdir() if p.is_file()) if staging.is_dir() else []:
            dest = target / f.name
            if dest.exists():
                f.unlink()
                continue
            os.replace(f, dest)  # same file system: atomic
            manifest.files[dest.relative_to(cache).as_posix()] = file_record(dest, recorded_by)
            moved += 1
        return moved

    moved = update_manifest(cache, commit)
    shutil.rmtree(staging, ignore_errors=True)
    return moved
