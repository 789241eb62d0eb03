"""Moving a compile cache between hosts: `pack` its finished entries and manifest into one
.tar.gz (a local file or an s3:// object), `unpack` an archive into a cache.

An archive is checked whole before anything reaches the cache: every member must be a plain
relative file listed in the archive's manifest, with that manifest's size and SHA-256. Nothing
existing is overwritten, locally or on S3.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path, PurePosixPath

from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.fileio import is_s3, new_output
from neuron_train.precompile.maintenance import check_files
from neuron_train.precompile.store import (
    MANIFEST,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    STAGING_DIR,
    USE_LOCK,
    Entry,
    file_lock,
    file_record,
    load_manifest,
    merge_manifest,
    recordable,
    scan,
    sha256_file,
    update_manifest,
)


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
    if not is_s3(dest):
        new_output(dest, "cache pack FILE")  # refused before any work: never overwritten
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
