"""Moving a compile cache between hosts: `pack` its finished entries and manifest into one
.tar.gz (a local file or an s3:// object), `unpack` an archive into a cache.

An archive is checked whole before anything reaches the cache: every member must be a plain
relative file listed in the archive's manifest, with that manifest's size and SHA-256. Nothing
existing is overwritten, locally or on S3.
"""

from __future__ import annotations

import errno
import io
import json
import os
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from neuron_train.common import reader, writer
from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.fileio import is_s3, new_output, remove_path, stale_work_paths, work_path
from neuron_train.precompile.maintenance import check_files, unvouched
from neuron_train.precompile.manifest import Manifest, ManifestError
from neuron_train.precompile.store import (
    MANIFEST,
    MANIFEST_LIMIT,
    STAGING_DIR,
    USE_LOCK,
    Entry,
    cache_path,
    file_lock,
    file_record,
    load_manifest,
    recordable,
    require_cache,
    scan,
    sha256_file,
    update_manifest,
)


def split_s3(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("s3://"):].partition("/")
    if not bucket or not key or key.endswith("/"):
        raise UsageError(f"expected s3://BUCKET/KEY (a file name, not a prefix), got {url!r}")
    return bucket, key


def _s3_client(url: str) -> Any:  # a boto3 S3 client: boto3 ships no types
    try:
        import boto3
    except ImportError:
        raise UsageError(f"{url}: S3 needs boto3 (pip install boto3)") from None
    session = boto3.session.Session()
    if session.get_credentials() is None:
        raise UsageError(f"{url}: no AWS credentials found (instance role, AWS_PROFILE or "
                         "`aws configure`); or pack to a local file and copy it yourself")
    return session.client("s3")


def _s3_exists(client: Any, bucket: str, key: str) -> bool:
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


@dataclass
class PackResult:
    entries: int
    files: int
    bytes: int
    left_out: list[str]          # failed, locked and unfinished entries, not packed


@dataclass
class UnpackResult:
    new_files: int
    identical: int               # already in the cache with the same checksum
    configs: int                 # configurations merged into the manifest


def pack(cache: Path, dest: str, adopt: bool = False) -> PackResult:
    """Write the cache's finished entries and their manifest into one .tar.gz (or s3:// object)."""
    cache = Path(cache)
    if not cache.is_dir():
        raise UsageError(f"no such cache directory: {cache}")
    require_cache(cache, "pack", adopt)  # pack writes its lock file into the cache
    client = None
    if is_s3(dest):
        bucket, key = split_s3(dest)
        client = _s3_client(dest)
        if _s3_exists(client, bucket, key):
            raise UsageError(f"{dest} already exists: choose another key (nothing is overwritten)")
    else:
        new_output(dest, "cache pack FILE")  # refused before any work: never overwritten
        for stale in stale_work_paths(Path(dest), "part"):
            remove_path(stale)  # a pack killed mid-write (kill -9, power loss) left it
    with file_lock(cache / USE_LOCK, shared=True):
        packed, keep, left = _packed_manifest(cache, adopt)
        if client is not None:
            with _staging(cache, "pack") as tmp:
                _write_archive(cache, packed, tmp / "cache.tar.gz")
                client.upload_file(str(tmp / "cache.tar.gz"), *split_s3(dest))
        else:
            _publish_archive(cache, packed, Path(dest))
    return PackResult(entries=len(keep), files=len(packed.files), bytes=sum(e.size for e in keep),
                      left_out=[e.path for e in left])


def _packed_manifest(cache: Path, adopt: bool = False) -> tuple[Manifest, list[Entry], list[Entry]]:
    """The archive's manifest (every configuration, the finished entries' files), or refuse."""
    manifest = load_manifest(cache)
    bad = [f for f in check_files(cache, manifest.files) if f.problem == "corrupt"]
    if bad:
        raise RunError(f"refusing to pack a damaged cache ({len(bad)} damaged file(s), e.g. "
                       f"{bad[0].entry}: {bad[0].detail}): run `neuron-train cache verify --quarantine` first")
    keep, left = packable(scan(cache))
    # What prune cannot vouch for is not ours to vouch for elsewhere (unpacked, it would be recorded
    # there, then pruned), unless the user vouches for the whole folder with --adopt.
    foreign = [] if adopt else unvouched(cache, keep, manifest)
    keep, left = [e for e in keep if e not in foreign], left + foreign
    packed = Manifest(configs=manifest.configs)
    for entry in keep:
        for rel in entry.files:
            packed.files[rel] = manifest.files.get(rel) or file_record(cache / rel, "pack")
    return packed, keep, left


def _write_archive(cache: Path, packed: Manifest, archive: Path) -> None:
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo(MANIFEST)
        payload = json.dumps(packed.to_json(), indent=2).encode()
        info.size, info.mtime = len(payload), int(time.time())
        tar.addfile(info, io.BytesIO(payload))
        for rel in sorted(packed.files):
            tar.add(cache_path(cache, rel), arcname=rel, recursive=False)


def _publish_archive(cache: Path, packed: Manifest, dest: Path) -> None:
    """Write the archive beside `dest` under a temporary name, then give it its name.

    On any failure (a full disk, an interrupt) the partial file is removed. The final name is
    taken with a hard link, which fails rather than replace a file that appeared meanwhile.
    """
    part = work_path(dest, "part")
    try:
        _write_archive(cache, packed, part)
        if not writer.link_new(part, dest):
            raise UsageError(f"{dest} already exists: choose another file name (nothing is overwritten)")
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise RunError(f"cannot pack into {dest}: {exc.strerror or exc}{where}; the partial archive "
                       "was removed") from None
    finally:
        writer.remove_ours(part)


def _safe_member(member: tarfile.TarInfo) -> str:
    rel = PurePosixPath(member.name)
    if rel.is_absolute() or ".." in rel.parts or not (member.isfile() or member.isdir()):
        raise RunError(f"archive member {member.name!r} is not a plain relative file: refusing to unpack")
    return rel.as_posix()


@contextmanager
def _staging(cache: Path, kind: str) -> Iterator[Path]:
    """A private folder in the cache, `.staging.KIND-HOST-PID`, removed afterwards; the ones of
    this host's dead processes (a command killed with -9) are removed first."""
    final = cache / STAGING_DIR.lstrip(".")
    for stale in stale_work_paths(final, kind):
        remove_path(stale)
    tmp = work_path(final, kind)
    remove_path(tmp)  # a leftover of a dead process that had our pid
    tmp.mkdir()
    try:
        yield tmp
    finally:
        remove_path(tmp)


def _target_cache(cache: Path, adopt: bool) -> None:
    """The cache to unpack into: a folder we may write into (created when missing), and a cache."""
    if cache.exists() and not cache.is_dir():
        raise UsageError(f"--cache-dir {cache} is a file, not a folder: choose another --cache-dir")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--cache-dir {cache}: cannot create it ({exc.strerror}): choose another "
                         "--cache-dir") from None
    if not os.access(cache, os.W_OK | os.X_OK):  # also false on a read-only mount
        raise UsageError(f"--cache-dir {cache} is not writable (read-only or no permission): choose "
                         "another --cache-dir")
    require_cache(cache, "unpack", adopt)


def unpack(source: str, cache: Path, adopt: bool = False) -> UnpackResult:
    """Add an archive's entries to a cache: verified first, nothing existing is overwritten."""
    cache = Path(cache)
    if not is_s3(source) and not Path(source).is_file():
        raise UsageError(f"no such archive: {source}")
    _target_cache(cache, adopt)
    try:
        with file_lock(cache / USE_LOCK, shared=True), _staging(cache, "unpack") as staging:
            archive = Path(source)
            if is_s3(source):
                archive = staging / "download.tar.gz"
                _s3_client(source).download_file(*split_s3(source), str(archive))
            incoming = _extract_verified(archive, staging / "files")
            new = update_manifest(cache, lambda m: _merge_files(cache, staging / "files", incoming, m))
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise RunError(f"no space left on the device of {cache}: nothing was unpacked (the partial "
                           "files were removed); free some space and unpack again") from None
        raise RunError(f"cannot unpack into {cache}: {exc.strerror or exc}") from None
    return UnpackResult(new_files=len(new), identical=len(incoming.files) - len(new),
                        configs=len(incoming.configs))


def _merge_files(cache: Path, extracted: Path, incoming: Manifest, manifest: Manifest) -> list[str]:
    """Move the archive's new files into the cache; refuse if an existing one differs.

    Runs under the manifest lock, so no committer can slip a file in between the check and the move.
    """
    targets = {rel: cache_path(cache, rel) for rel in sorted(incoming.files)}  # all confined, or none moved
    new = [rel for rel, target in targets.items() if not target.exists()]
    conflicts = [rel for rel, rec in sorted(incoming.files.items())
                 if rel not in new and sha256_file(targets[rel]) != rec.sha256]
    if conflicts:
        raise UsageError(f"refusing to unpack: {len(conflicts)} file(s) already in {cache} "
                         f"differ from the archive (e.g. {conflicts[0]}); unpack into an empty "
                         "directory or prune those entries first")
    for rel in new:
        targets[rel].parent.mkdir(parents=True, exist_ok=True)
        os.replace(cache_path(extracted, rel), targets[rel])
    manifest.merge(incoming)
    return new


def _read_archive_manifest(tar: tarfile.TarFile, member: tarfile.TarInfo, archive: Path) -> Manifest:
    try:
        raw = tar.extractfile(member)  # None when the member is not a regular file
        if raw is None:
            raise RunError(f"{archive}: its {MANIFEST} is not a regular file")
        if member.size > MANIFEST_LIMIT:  # the bound common.reader puts on a cache's own manifest
            raise RunError(f"{archive}: its {MANIFEST} is {member.size:,} bytes, more than any manifest")
        data = reader.parse(raw.read(MANIFEST_LIMIT + 1).decode("utf-8"), "json", f"{archive}: its {MANIFEST}")
    except UnicodeDecodeError as exc:
        raise RunError(f"{archive}: its {MANIFEST} is not valid JSON ({exc})") from None
    except UsageError as exc:  # not JSON, nested too deeply, an absurd integer
        raise RunError(f"{exc}; refusing to unpack") from None
    try:
        return Manifest.from_json(data, f"{archive}: {MANIFEST}")
    except ManifestError as exc:
        raise ManifestError(f"{exc}; refusing to unpack (was it made by `neuron-train cache pack`?)") from None


def _extract_verified(archive: Path, into: Path) -> Manifest:
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
            incoming = _read_archive_manifest(tar, members[MANIFEST], archive)
            for rel, member in members.items():
                if member.isdir() or rel == MANIFEST:
                    continue
                if rel not in incoming.files:
                    raise RunError(f"{archive}: member {rel} is not listed in its manifest")
                if member.size != incoming.files[rel].size:  # checked before a byte is written
                    raise RunError(f"{archive} is damaged: member {rel} is {member.size} bytes, its "
                                   f"manifest says {incoming.files[rel].size}")
                tar.extract(member, into, filter="data")
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
                raise  # our side, not the archive's: said by unpack
            raise RunError(f"{archive} is damaged: {exc}") from None
        except (tarfile.TarError, EOFError) as exc:
            raise RunError(f"{archive} is damaged: {exc}") from None
    missing = [rel for rel in incoming.files if not (into / rel).is_file()]
    if missing:
        raise RunError(f"{archive} is incomplete: {missing[0]} is listed but absent")
    damaged = check_files(into, incoming.files)
    if damaged:
        raise RunError(f"{archive} is damaged: {damaged[0].entry}: {damaged[0].detail}")
    return incoming
