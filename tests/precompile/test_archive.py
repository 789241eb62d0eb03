"""precompile/archive.py in-process: `cache pack` / `cache unpack` called as functions.

The CLI tests of test_cache.py run them in subprocesses, where mutmut cannot see them; these
check the same promises in-process (docs/measurements.md, "Scores"): a pack holds exactly the finished
entries and never replaces a file, an unpack adds them byte for byte, never replaces a file the
cache has, and refuses an archive that does not match its manifest before anything reaches the cache.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from neuron_train.common.errors import RunError, UsageError
from neuron_train.precompile import archive, store
from neuron_train.precompile.manifest import GraphRecord
from tests.precompile.test_cache import CONFIG, VERSION_DIR, add_config, neuron_entry, xla_entry

XLA_A, XLA_B = "67939951107342009493273238831484768838", "123116424461872025944304137096563822046"
DONE = "MODULE_9219523464496887986+abb26765"


@pytest.fixture
def cache(tmp_path) -> Path:
    """Two finished entries (a Neuron module, an xla file), one failed and one locked entry."""
    c = tmp_path / "cache"
    neuron_entry(c, DONE, "compiled")
    neuron_entry(c, "MODULE_02e0833b58066ea94f2c+2c2d707e", "failed")
    neuron_entry(c, "MODULE_17109392703413819652+abb26765", "locked")
    xla_entry(c, XLA_A)
    xla_entry(c, XLA_B, size=4000)
    add_config(c, "aaaaaaaaaaaaaaaa", CONFIG, {"h1": GraphRecord(phase="train", step=0)})
    store.record_entries(c, "aaaaaaaaaaaaaaaa")
    return c


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != store.MANIFEST and not p.name.endswith(".lock")}


def finished(cache: Path) -> dict[str, bytes]:
    return {rel: data for rel, data in files_of(cache).items()
            if rel.startswith("xla/") or rel.startswith(f"{VERSION_DIR}/{DONE}/")}


def test_pack_then_unpack_moves_exactly_the_finished_entries_byte_for_byte(cache, tmp_path):
    dest = tmp_path / "warm.tar.gz"
    packed = archive.pack(cache, str(dest))
    assert (packed.entries, packed.files) == (3, len(finished(cache)))
    assert packed.bytes == sum(len(d) for d in finished(cache).values())
    assert sorted(packed.left_out) == sorted(f"{VERSION_DIR}/{m}" for m in (
        "MODULE_02e0833b58066ea94f2c+2c2d707e", "MODULE_17109392703413819652+abb26765"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".warm")]  # no partial file left

    other = tmp_path / "other"
    result = archive.unpack(str(dest), other)
    assert (result.new_files, result.identical, result.configs) == (len(finished(cache)), 0, 1)
    assert files_of(other) == finished(cache)
    manifest = store.load_manifest(other)
    assert set(manifest.files) == set(finished(cache)) and set(manifest.configs) == {"aaaaaaaaaaaaaaaa"}
    assert [p.name for p in other.iterdir() if p.name.startswith(".staging")] == []  # private folder removed

    again = archive.unpack(str(dest), other)  # the same archive twice: nothing new, nothing changed
    assert (again.new_files, again.identical) == (0, len(finished(cache)))
    assert files_of(other) == finished(cache)


def test_pack_never_replaces_a_file_and_refuses_what_is_not_a_cache(cache, tmp_path):
    dest = tmp_path / "warm.tar.gz"
    dest.write_text("precious")
    with pytest.raises(UsageError, match="already exists"):
        archive.pack(cache, str(dest))
    assert dest.read_text() == "precious"
    with pytest.raises(UsageError, match="no such cache directory"):
        archive.pack(tmp_path / "missing", str(tmp_path / "new.tar.gz"))
    assert not (tmp_path / "new.tar.gz").exists()


def test_pack_refuses_a_damaged_cache_and_writes_nothing(cache, tmp_path):
    (cache / "xla" / XLA_A).write_bytes(b"changed")
    with pytest.raises(RunError, match=r"refusing to pack a damaged cache \(1 damaged file"):
        archive.pack(cache, str(tmp_path / "warm.tar.gz"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_unpack_never_replaces_a_different_file_the_cache_has(cache, tmp_path):
    dest = tmp_path / "warm.tar.gz"
    archive.pack(cache, str(dest))
    other = tmp_path / "other"
    archive.unpack(str(dest), other)
    (other / "xla" / XLA_A).write_bytes(b"someone else's")
    before = files_of(other)
    with pytest.raises(UsageError, match=r"refusing to unpack: 1 file\(s\) already in .* differ from the archive "
                                         r"\(e.g. xla/\d+\); unpack into an empty directory or prune those "
                                         r"entries first$"):
        archive.unpack(str(dest), other)
    assert files_of(other) == before


def test_unpack_refuses_what_is_not_an_archive_or_a_folder(tmp_path):
    with pytest.raises(UsageError, match="no such archive"):
        archive.unpack(str(tmp_path / "none.tar.gz"), tmp_path / "c")
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a.tar.gz").write_bytes(b"not gzip")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        archive.unpack(str(tmp_path / "a.tar.gz"), tmp_path / "a-file")
    with pytest.raises(RunError, match="is not a readable .tar.gz archive"):
        archive.unpack(str(tmp_path / "a.tar.gz"), tmp_path / "c")
    assert files_of(tmp_path / "c") == {}


def rewrite(src: Path, dst: Path, change) -> None:
    """A copy of archive `src` with each member (and its bytes) passed through `change`."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w:gz") as tout:
        for member in tin.getmembers():
            data = tin.extractfile(member).read() if member.isfile() else b""
            for m, d in change(member, data):
                m.size = len(d)
                tout.addfile(m, io.BytesIO(d))


def _manifest_lists(extra: str):
    def change(member, data):
        if member.name == store.MANIFEST:
            return [(member, json.dumps(json.loads(data) | {"files": {
                **json.loads(data)["files"], extra: {"sha256": "0" * 64, "size": 3, "recorded": "t",
                                                     "recorded_by": "x"}}}).encode())]
        return [(member, data)]
    return change


def _as_dir(member):
    member.type = tarfile.DIRTYPE
    return member


@pytest.mark.parametrize("change, message", [
    (lambda m, d: [(m, d[:-1] if m.name.startswith("xla/") else d)],
     r"is damaged: member xla/\S+ is \d+ bytes, its manifest says"),
    (lambda m, d: [(m, d)] + ([(tarfile.TarInfo("xla/unlisted"), b"abc")] if m.name == store.MANIFEST else []),
     "member xla/unlisted is not listed in its manifest"),
    (lambda m, d: [] if m.name == store.MANIFEST else [(m, d)], "has no manifest.json: not made by"),
    (lambda m, d: [(m, b"{not json" if m.name == store.MANIFEST else d)], "its manifest.json is not valid JSON"),
    (lambda m, d: [(m, b"[]" if m.name == store.MANIFEST else d)],
     "not a neuron-train graph manifest.*refusing to unpack"),
    (_manifest_lists("xla/absent"), "is incomplete: xla/absent is listed but absent"),
    (lambda m, d: [(m, bytes([d[0] ^ 1]) + d[1:] if m.name.startswith("xla/") else d)], "damaged"),
    (lambda m, d: [(_as_dir(m), b"") if m.name == store.MANIFEST else (m, d)],
     "its manifest.json is not a regular file"),
    (lambda m, d: [(m, b"[" * 100000 + b"]" * 100000 if m.name == store.MANIFEST else d)],
     "its manifest.json: nested too deeply .*; refusing to unpack"),
])
def test_an_archive_that_does_not_match_its_manifest_is_refused_before_anything_reaches_the_cache(
        cache, tmp_path, change, message):
    good, bad = tmp_path / "good.tar.gz", tmp_path / "bad.tar.gz"
    archive.pack(cache, str(good))
    rewrite(good, bad, change)
    other = tmp_path / "other"
    with pytest.raises(RunError, match=message):
        archive.unpack(str(bad), other)
    assert files_of(other) == {} and not (other / store.MANIFEST).exists()
    assert [p.name for p in other.iterdir() if p.name.startswith(".staging")] == []


def test_an_s3_url_needs_a_bucket_and_a_key():
    assert archive.split_s3("s3://bucket/caches/warm.tar.gz") == ("bucket", "caches/warm.tar.gz")
    for url in ("s3://bucket-only", "s3://bucket/", "s3:///key"):
        with pytest.raises(UsageError, match="s3://BUCKET/KEY"):
            archive.split_s3(url)


def test_pack_changes_nothing_in_a_folder_that_is_not_a_cache_unless_adopted(tmp_path):
    """A torch_xla cache without our manifest (or any folder): refused by default, `--adopt` packs it."""
    folder = tmp_path / "xla-cache"
    xla_entry(folder, XLA_A)
    (folder / "notes.txt").write_text("someone's")
    with pytest.raises(UsageError, match=r"is not a compile cache .*`cache pack` changes nothing in it"):
        archive.pack(folder, str(tmp_path / "warm.tar.gz"))
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "xla"]
    assert not (tmp_path / "warm.tar.gz").exists()
    assert archive.pack(folder, str(tmp_path / "warm.tar.gz"), adopt=True).files == 1


def test_unpack_into_a_folder_that_is_not_a_cache_changes_nothing_unless_adopted(cache, tmp_path):
    dest = tmp_path / "warm.tar.gz"
    archive.pack(cache, str(dest))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("someone's")
    with pytest.raises(UsageError, match=r"is not a compile cache .*`cache unpack` changes nothing in it; check "
                                         r"--cache-dir, or pass --adopt"):
        archive.unpack(str(dest), folder)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    assert archive.unpack(str(dest), folder, adopt=True).new_files == len(finished(cache))
    assert files_of(folder) == finished(cache) | {"notes.txt": b"someone's"}


def test_unpack_into_a_cache_dir_that_cannot_be_created_says_so_in_one_line(cache, tmp_path):
    dest = tmp_path / "warm.tar.gz"
    archive.pack(cache, str(dest))
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UsageError) as err:
        archive.unpack(str(dest), tmp_path / "a-file" / "sub")
    assert str(err.value) == (f"--cache-dir {tmp_path / 'a-file' / 'sub'}: cannot create it (Not a directory): "
                              "choose another --cache-dir")


def test_unpack_names_the_fix_and_changes_nothing_when_the_disk_fills_or_a_move_fails(cache, tmp_path, monkeypatch):
    """A full disk (or any other OSError) while moving files in: one line, the cache as it was."""
    import errno
    import os
    dest = tmp_path / "warm.tar.gz"
    archive.pack(cache, str(dest))
    other = tmp_path / "other"
    other.mkdir()
    for code, message in [(errno.ENOSPC, f"no space left on the device of {other}: nothing was unpacked (the "
                           "partial files were removed); free some space and unpack again"),
                          (errno.EIO, f"cannot unpack into {other}: Input/output error")]:
        def full(src, dst, code=code):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(archive.os, "replace", full)
        with pytest.raises(RunError) as err:
            archive.unpack(str(dest), other, adopt=True)
        assert str(err.value) == message
        assert files_of(other) == {} and not (other / store.MANIFEST).exists()
        assert [p.name for p in other.iterdir() if p.name.startswith(".staging")] == []


def test_a_damaged_member_is_named_with_what_is_wrong(cache, tmp_path):
    good, bad = tmp_path / "good.tar.gz", tmp_path / "bad.tar.gz"
    archive.pack(cache, str(good))
    rewrite(good, bad, lambda m, d: [(m, bytes([d[0] ^ 1]) + d[1:] if m.name == f"xla/{XLA_A}" else d)])
    with pytest.raises(RunError) as err:
        archive.unpack(str(bad), tmp_path / "other")
    assert str(err.value).startswith(f"{bad} is damaged: xla/{XLA_A}: ")
    assert "sha256" in str(err.value).lower() or "checksum" in str(err.value).lower()


def test_a_pack_that_fails_midway_names_the_file_and_leaves_no_partial_archive(cache, tmp_path, monkeypatch):
    def full(cache, packed, part):
        part.write_bytes(b"half")
        raise OSError(28, "No space left on device", str(part))
    monkeypatch.setattr(archive, "_write_archive", full)
    dest = tmp_path / "warm.tar.gz"
    with pytest.raises(RunError) as err:
        archive.pack(cache, str(dest))
    part = archive.work_path(dest, "part")
    assert str(err.value) == (f"cannot pack into {dest}: No space left on device ({part}); the partial "
                              "archive was removed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_a_file_that_appears_while_packing_is_not_replaced(cache, tmp_path, monkeypatch):
    """The race after the early check: `dest` created by someone else while the archive was written."""
    import errno
    packed = archive._packed_manifest(cache)[0]
    dest = tmp_path / "warm.tar.gz"
    dest.write_text("theirs")
    with pytest.raises(UsageError) as err:
        archive._publish_archive(cache, packed, dest)
    assert str(err.value) == f"{dest} already exists: choose another file name (nothing is overwritten)"

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(archive.os, "link", no_links)  # a file system without hard links
    with pytest.raises(UsageError) as err:
        archive._publish_archive(cache, packed, dest)
    assert str(err.value) == f"{dest} already exists: choose another file name (nothing is overwritten)"
    assert dest.read_text() == "theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["cache", "warm.tar.gz"]
    fresh = tmp_path / "fresh.tar.gz"
    archive._publish_archive(cache, packed, fresh)
    assert archive.unpack(str(fresh), tmp_path / "other").new_files == len(finished(cache))


class StandInS3:
    """An in-memory stand-in for the boto3 S3 client: it tests only OUR contract with S3 (what
    we upload under which key, that an existing object is never overwritten, how botocore's errors
    become one line), never S3 itself. head_object raises ClientError the way botocore does."""

    def __init__(self, objects=None, head_error=None):
        self.objects, self.head_error, self.uploads = dict(objects or {}), head_error, []

    def head_object(self, Bucket, Key):
        from botocore.exceptions import ClientError
        if self.head_error:
            raise ClientError({"Error": {"Code": self.head_error, "Message": "Forbidden"}}, "HeadObject")
        if (Bucket, Key) not in self.objects:
            raise ClientError({"Error": {"Code": "404", "Message": "Not Found"}}, "HeadObject")
        return {}

    def upload_file(self, filename, bucket, key):
        self.uploads.append((bucket, key))
        self.objects[(bucket, key)] = Path(filename).read_bytes()

    def download_file(self, bucket, key, filename):
        Path(filename).write_bytes(self.objects[(bucket, key)])


def test_pack_to_s3_uploads_the_archive_under_its_key_and_never_overwrites(cache, tmp_path, monkeypatch):
    """Contract with S3 through a stand-in client (see StandInS3): not a test of S3."""
    s3 = StandInS3()
    urls = []
    monkeypatch.setattr(archive, "_s3_client", lambda url: urls.append(url) or s3)
    url = "s3://bucket/caches/warm.tar.gz"
    assert archive.pack(cache, url).files == len(finished(cache))
    assert s3.uploads == [("bucket", "caches/warm.tar.gz")] and urls == [url]
    assert [p.name for p in cache.iterdir() if p.name.startswith(".staging")] == []
    result = archive.unpack(url, tmp_path / "other")
    assert result.new_files == len(finished(cache)) and files_of(tmp_path / "other") == finished(cache)
    assert urls == [url, url]
    before = dict(s3.objects)
    with pytest.raises(UsageError) as err:
        archive.pack(cache, url)
    assert str(err.value) == f"{url} already exists: choose another key (nothing is overwritten)"
    assert s3.objects == before and len(s3.uploads) == 1


def test_an_s3_error_other_than_not_found_is_one_line(cache, monkeypatch):
    """Contract with S3 through a stand-in client (see StandInS3): a 403 on HEAD is said, not packed over."""
    s3 = StandInS3(head_error="403")
    monkeypatch.setattr(archive, "_s3_client", lambda url: s3)
    with pytest.raises(RunError) as err:
        archive.pack(cache, "s3://bucket/warm.tar.gz")
    assert str(err.value).startswith("s3://bucket/warm.tar.gz: An error occurred (403) when calling the "
                                     "HeadObject operation")
    assert s3.uploads == []
    for code in ("NoSuchKey", "NotFound"):
        assert archive._s3_exists(StandInS3(head_error=code), "bucket", "k") is False


def test_s3_without_credentials_is_one_line_naming_the_fix(monkeypatch, tmp_path):
    """botocore's own credential lookup with every source emptied (no network: IMDS disabled)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(UsageError) as err:
        archive._s3_client("s3://b/k")
    assert str(err.value) == ("s3://b/k: no AWS credentials found (instance role, AWS_PROFILE or `aws "
                              "configure`); or pack to a local file and copy it yourself")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    assert archive._s3_client("s3://b/k").meta.service_model.service_name == "s3"


def test_an_os_error_while_extracting_is_ours_or_the_archives(cache, tmp_path, monkeypatch):
    """EACCES (our side) is said by unpack as `cannot unpack into`; any other errno is the archive's."""
    import errno
    import os
    good = tmp_path / "good.tar.gz"
    archive.pack(cache, str(good))
    other = tmp_path / "other"
    for code, message in [(errno.EACCES, f"cannot unpack into {other}: Permission denied"),
                          (errno.EIO, f"{good} is damaged: [Errno 5] Input/output error")]:
        def fail(self, *args, code=code, **kwargs):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(tarfile.TarFile, "extract", fail)
        with pytest.raises(RunError) as err:
            archive.unpack(str(good), other)
        assert str(err.value) == message
        assert files_of(other) == {} and not (other / store.MANIFEST).exists()


def test_a_dead_packs_partial_archive_is_removed_by_the_next_pack_and_a_live_ones_kept(cache, tmp_path):
    """A pack killed mid-write (kill -9) left `.NAME.part-HOST-PID`: the next pack removes it,
    never the partial file of a pack still running (pid 1 is alive)."""
    import subprocess
    dest = tmp_path / "warm.tar.gz"
    gone = subprocess.Popen(["true"])
    gone.wait(timeout=60)
    dead = archive.work_path(dest, "part").with_name(archive.work_path(dest, "part").name.rsplit("-", 1)[0]
                                                     + f"-{gone.pid}")
    live = dead.with_name(dead.name.rsplit("-", 1)[0] + "-1")
    dead.write_bytes(b"half")
    live.write_bytes(b"writing")
    archive.pack(cache, str(dest))
    assert not dead.exists() and live.read_bytes() == b"writing"
    with pytest.raises(UsageError) as err:
        archive.pack(cache, str(dest))
    assert str(err.value) == (f"cache pack FILE: {dest} already exists: remove it or choose another file "
                              "(nothing is overwritten)")


def test_an_unpack_into_a_folder_it_may_not_write_is_refused_before_anything_is_read(cache, tmp_path, monkeypatch):
    """A read-only mount (or, for another user, no permission): os.access says so, one line names the fix."""
    good = tmp_path / "good.tar.gz"
    archive.pack(cache, str(good))
    target = tmp_path / "ro"
    target.mkdir()
    asked = []
    monkeypatch.setattr(archive.os, "access", lambda path, mode: asked.append(mode) or False)
    with pytest.raises(UsageError) as err:
        archive.unpack(str(good), target)
    assert str(err.value) == (f"--cache-dir {target} is not writable (read-only or no permission): choose another "
                              "--cache-dir")
    assert asked == [os.W_OK | os.X_OK] and list(target.iterdir()) == []
