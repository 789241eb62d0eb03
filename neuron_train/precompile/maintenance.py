"""Keeping a compile cache sound: `verify` (checksums, failed compiles, leftovers), `quarantine`
(damaged entries moved aside, never deleted) and `prune` (by age, total size or failure).

Quarantine and prune need the cache to themselves: they take the use lock exclusively and refuse
while a precompile or a run holds it (store.py).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from neuron_train.common import writer
from neuron_train.common.errors import UsageError
from neuron_train.common.fileio import stale_work_paths, work_path
from neuron_train.precompile.manifest import XLA_DIR, FileRecord, Manifest, entry_of
from neuron_train.precompile.store import (
    FAILED,
    INCOMPLETE,
    LOCKED,
    PRUNE_MARK,
    USE_LOCK,
    Entry,
    cache_path,
    file_lock,
    has_manifest,
    is_compiler_artifact,
    load_manifest,
    require_cache,
    scan,
    sha256_file,
    update_manifest,
    utc_now,
)

QUARANTINE_DIR = "quarantine"
SIZE_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# verify findings that make the cache unsafe to use (exit 1); the others are information.
BAD_FINDINGS = ("corrupt", "missing", FAILED)


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


def check_files(cache: Path, files: dict[str, FileRecord]) -> list[Finding]:
    """Compare recorded files with the disk: missing, truncated or modified ones."""
    findings = []
    for rel, rec in sorted(files.items()):
        path, entry = cache_path(cache, rel), entry_of(rel)
        name = f"{rel[len(entry) + 1:]}: " if rel != entry else ""  # the file within a Neuron entry
        if not path.is_file():
            findings.append(Finding(entry, "missing", f"{name}recorded but gone"))
            continue
        size = path.stat().st_size
        if size != rec.size:
            findings.append(Finding(entry, "corrupt", f"{name}{size} bytes, {rec.size} when recorded "
                                                      "(truncated or rewritten)"))
        elif sha256_file(path) != rec.sha256:
            findings.append(Finding(entry, "corrupt", f"{name}checksum differs from the manifest "
                                                      "(modified after it was recorded)"))
    return findings


def verify(cache: Path, manifest: Manifest | None = None) -> list[Finding]:
    """All problems of a cache: damaged or missing recorded files, failed compiles, leftovers."""
    cache = Path(cache)
    manifest = manifest if manifest is not None else load_manifest(cache)
    findings = check_files(cache, manifest.files)
    for entry in scan(cache):
        if entry.state == FAILED:
            findings.append(Finding(entry.path, FAILED, _failed_reason(cache, entry)))
        elif entry.state == LOCKED:
            findings.append(Finding(entry.path, LOCKED, "a compile is running, or was interrupted "
                                                        "(neuron_parallel_compile --command clear-locks)"))
        elif entry.state == INCOMPLETE:
            findings.append(Finding(entry.path, INCOMPLETE, "graph extracted but never compiled"))
        elif not any(f in manifest.files for f in entry.files):
            findings.append(Finding(entry.path, "unrecorded", "not in the manifest (compiled by a "
                                                              "run, not by precompile)"))
    return findings


def quarantine(cache: Path, findings: list[Finding], adopt: bool = False) -> Path | None:
    """Move corrupt entries aside (never deleted) and forget records of missing files.

    Needs the cache to itself: a running process could be loading the entry being moved.
    """
    cache = Path(cache)
    corrupt = sorted({f.entry for f in findings if f.problem == "corrupt"})
    bad = {f.entry for f in findings if f.problem in ("corrupt", "missing")}
    if not bad:
        return None
    require_cache(cache, "verify --quarantine", adopt)
    stamp = Path(QUARANTINE_DIR) / time.strftime("%Y%m%d-%H%M%S")
    dest_root = cache / stamp
    with file_lock(cache / USE_LOCK, wait=False, purpose="quarantine needs the cache to itself"):
        for rel in corrupt:
            # every folder on the way is a real folder of the cache: a link would move the file outside
            dest = writer.make_folders(cache, stamp / Path(rel).parent) / Path(rel).name
            os.replace(cache_path(cache, rel), dest)

        update_manifest(cache, lambda manifest: manifest.forget_entries(bad, utc_now()))
        for mark in interrupted_prunes(cache):  # what they left recorded is forgotten now
            writer.remove_ours(mark)
    return dest_root if corrupt else None


# ----------------------------------------------------------------------------- prune


def _quantity(number: str) -> float | None:
    """A finite number >= 0, or None ('nan', 'inf', '-1', 'lots' are not sizes or ages)."""
    try:
        value = float(number)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def parse_size(text: str) -> int:
    """'50G', '500M', '1.5T', '123' (bytes) -> bytes (binary units)."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in SIZE_UNITS else ""
    value = _quantity(raw[: len(raw) - len(unit)])
    if value is None:
        raise UsageError(f"--max-size: expected a size >= 0 like 500M, 20G or 1T, got {text!r}")
    size = value * SIZE_UNITS[unit]
    if size >= 2**63:  # 1e308T is infinite once multiplied
        raise UsageError(f"--max-size: {text!r} is more bytes than any disk holds (at most 8388608T): give a size "
                         "like 500M, 20G or 1T")
    return int(size)


def parse_age(text: str) -> float:
    """'30d', '12h', '90m', '2w', '45s' -> seconds."""
    raw = text.strip().lower()
    unit, value = raw[-1:], _quantity(raw[:-1])
    if unit not in AGE_UNITS or value is None:
        raise UsageError(f"--older-than: expected an age >= 0 like 30d, 12h, 90m or 2w, got {text!r}")
    return value * AGE_UNITS[unit]


def _vouched_file(cache: Path, rel: str, manifest: Manifest) -> bool:
    """Listed in the manifest, or a compiler artifact directly in a Neuron MODULE_ folder."""
    parts = PurePosixPath(rel).parts
    return rel in manifest.files or (len(parts) == 3 and parts[0] != XLA_DIR and is_compiler_artifact(parts[2])
                                     and (cache / rel).is_file() and not (cache / rel).is_symlink())


def unvouched(cache: Path, entries: list[Entry], manifest: Manifest) -> list[Entry]:
    """Entries holding a file prune cannot vouch for: never deleted (they may not be ours)."""
    cache = Path(cache)
    out = []
    for e in entries:
        folder = cache / e.path
        files = ([p.relative_to(cache).as_posix() for p in folder.rglob("*") if not p.is_dir() or p.is_symlink()]
                 if folder.is_dir() and not folder.is_symlink() else [e.path])
        if not all(_vouched_file(cache, rel, manifest) for rel in files):
            out.append(e)
    return out


def select_prune(entries: list[Entry], *, now: float, older_than: float | None = None,
                 max_size: int | None = None, failed: bool = False,
                 protected: frozenset[str] = frozenset()) -> list[Entry]:
    """The entries to delete, oldest first. Locked entries (a compile in progress) and `protected`
    ones (holding files prune cannot vouch for) are never chosen."""
    candidates = sorted((e for e in entries if e.state != LOCKED and e.path not in protected),
                        key=lambda e: e.mtime)
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


def prune(cache: Path, chosen: list[Entry], announce: Callable[[Entry], None] = lambda e: None,
          adopt: bool = False) -> None:
    """Delete entries and their records; configurations that lose entries are marked as pruned.

    Takes the cache to itself first, so `announce` (called before each deletion) never reports a
    deletion that a running precompile or training run then prevents. Only files it can vouch for
    are deleted (`unvouched` entries are refused); a cache without a manifest does not get one.
    """
    cache = Path(cache)
    require_cache(cache, "prune", adopt)
    with file_lock(cache / USE_LOCK, wait=False, purpose="prune needs the cache to itself"):
        manifest = load_manifest(cache)
        foreign = unvouched(cache, chosen, manifest)
        if foreign:
            raise UsageError(f"{foreign[0].path} holds files prune cannot vouch for (not in the manifest, "
                             "not a compiler artifact): nothing deleted")
        mark = work_path(cache / PRUNE_MARK, "running")  # says, if we are killed, why files are missing
        os.close(writer.create_new(mark))
        done: set[str] = set()
        try:
            for e in chosen:
                announce(e)
                _remove_entry(cache, e.path, manifest)
                done.add(e.path)
        finally:  # a deletion that failed (a protected file) is said now: not later as a killed prune
            try:
                if done and has_manifest(cache):
                    update_manifest(cache, lambda manifest: manifest.forget_entries(done, utc_now()))
            finally:
                writer.remove_ours(mark)


def interrupted_prunes(cache: Path) -> list[Path]:
    """The marks of prunes killed before they rewrote the manifest: their deleted files are still
    recorded (`verify` says so, `quarantine` forgets them and removes the marks)."""
    return stale_work_paths(Path(cache) / PRUNE_MARK, "running")


def _remove_entry(cache: Path, rel: str, manifest: Manifest) -> None:
    """Delete one entry's vouched files inside the cache (its folder confined, never followed); a
    MODULE_ folder goes only once empty: a file that appeared meanwhile is kept, with its folder."""
    path = PurePosixPath(rel)
    target = cache_path(cache, str(path.parent)) / path.name
    if not target.is_dir() or target.is_symlink():
        writer.remove_ours(target)  # a file entry (or a link, itself): never a folder it points to
        return
    for child in sorted(target.rglob("*"), reverse=True):  # deepest first: folders after their files
        if child.is_dir() and not child.is_symlink():
            writer.remove_folder(child, [])  # only once empty
        # named from the entry, not from `cache`: `target` is resolved (the cache may be a relative
        # path or reached through a symbolic link), so `child` is not under `cache` as written
        elif _vouched_file(cache, f"{rel}/{child.relative_to(target).as_posix()}", manifest):
            writer.remove_ours(child)
    writer.remove_folder(target, [])  # only once empty
