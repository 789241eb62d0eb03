"""The one door for writes, as `common.reader` is the one door for reads: every file or folder a
command creates, replaces, appends to or deletes goes through here (tests/common/test_writer.py checks
that no module writes around it). The rules (docs/reliability.md, "The writer"):

- a link is never followed: not at the final component (O_NOFOLLOW), not in a folder we own;
- only a regular file is replaced or deleted: never a directory, device, FIFO or socket, even with
  --force;
- a new file is created without replacing anything (O_EXCL, or link(2) for a whole file), and a file
  probed up front is re-checked at the moment of writing: a file that appeared (or was swapped in)
  meanwhile is kept, ours goes beside it, said in one line;
- appending to a file with more than one hard link copies it first (the other names keep theirs);
- a folder is deleted entry by entry, only names we wrote, and only when nothing else is left in it;
- an output is probed before the work (`common.fileio.new_output`): /proc, /sys (`refuse_kernel_fs`)
  and read-only places (its access check and probe file) refused.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from neuron_train.common.errors import RunError, UsageError

_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symbolic link"}
_KERNEL = ("/proc", "/sys")  # kernel file systems: writes there do not make files
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}  # link(2) refused by the file system


def kind(mode: int) -> str:
    """What a file of this mode is, for a refusal ("a named pipe (FIFO)")."""
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


def lstat(path: Path) -> os.stat_result | None:
    """The entry itself (a link is not followed), or None when nothing has that name."""
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


@dataclass(frozen=True)
class Target:
    """An output probed before the work: `seen` is the identity (`_identity`) of the regular file
    there then (None: nothing was there); the write re-checks it (`write_file`)."""
    path: Path
    seen: tuple[int, int, int, int] | None = None


def refuse_kernel_fs(folder: Path, flag: str) -> None:
    """A folder under /proc or /sys is refused before any work (root's os.access calls it writable;
    a read-only mount is refused by common.fileio.new_output's access check and probe file)."""
    real = os.path.realpath(folder)
    for top in _KERNEL:
        if real == top or real.startswith(top + "/"):
            raise UsageError(f"{flag}: cannot write in {folder}: {top} is a kernel file system where no file "
                             "can be made: choose another location")


def probe_output(path: Path, flag: str, replace: bool = False) -> Target:
    """An output file checked before the work: it is absent, or (with `replace`) a regular file,
    never a link, a directory or a special file. (common.fileio.new_output adds the folder's checks,
    `refuse_kernel_fs` and a probe file.)"""
    path = Path(path)
    st = lstat(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{flag}: {path} is {kind(st.st_mode)}: only a regular file is ever replaced "
                         "(--force too): choose another file")
    if st is not None and not replace:
        raise UsageError(f"{flag}: {path} already exists: remove it or choose another file (nothing is overwritten)")
    return Target(path, None if st is None else _identity(st))


def _temp_beside(final: Path) -> tuple[int, Path]:
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")  # O_EXCL, 0600
    return fd, Path(tmp)


def _fill(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def link_new(tmp: Path, final: Path) -> bool:
    """Give `tmp` the name `final` only if nothing has that name (link(2) never replaces)."""
    try:
        os.link(tmp, final)  # tmp is our own regular file: nothing to follow
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        if lstat(final) is not None:  # no hard links here: the check and the rename are two steps
            return False
        os.rename(tmp, final)
        return True
    tmp.unlink()
    return True


def _beside(final: Path) -> Path:
    stem, suffix = final.stem, final.suffix
    n = 1
    while lstat(candidate := final.with_name(f"{stem}-{n}{suffix}")) is not None:
        n += 1
    return candidate


def write_file(target: Target | Path, data: bytes) -> Path:
    """`data` under the target's name, whole or not at all (a temporary file beside it, fsync, then
    a rename); returns the path written.

    A `Target` from `probe_output` is re-checked now: if the file there is not the one probed (one
    appeared, or another was swapped in), it is kept and ours goes beside it (`NAME-1.json`), said
    in one line. A bare Path replaces only a regular file (a run's own summary, a manifest)."""
    final = Path(target.path if isinstance(target, Target) else target)
    if isinstance(target, Target):
        expected = target.seen
    else:
        now = lstat(final)
        if now is not None and not stat.S_ISREG(now.st_mode):
            raise RunError(f"{final} is {kind(now.st_mode)}: only a regular file is replaced; move it away and "
                           "run again")
        expected = None if now is None else _identity(now)
    fd, tmp = _temp_beside(final)
    try:
        _fill(fd, data)
        if (expected is None or lstat(final) is None) and link_new(tmp, final):
            return final  # nothing had the name (or what was probed is gone): taken, nothing replaced
        if expected is not None and _same_id(expected, lstat(final)):
            os.replace(tmp, final)  # still the regular file seen before
            return final
        other = _beside(final)
        while not link_new(tmp, other):
            other = _beside(final)
        print(f"note: {final} appeared or changed while this command ran: it is kept; the output is {other}",
              file=sys.stderr, flush=True)
        return other
    finally:
        tmp.unlink(missing_ok=True)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """Device, inode, change time and size: a file deleted and another made meanwhile may reuse the
    inode (and the change time, at the clock tick's resolution)."""
    return st.st_dev, st.st_ino, st.st_ctime_ns, st.st_size


def _same_id(seen: tuple[int, int, int, int], now: os.stat_result | None) -> bool:
    return now is not None and stat.S_ISREG(now.st_mode) and _identity(now) == seen


def _open_regular(path: Path, flags: int, what: str) -> int:
    """os.open without following a link and without blocking on a FIFO; refused unless a regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError:
        st = lstat(path)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise RunError(f"{path} is {kind(st.st_mode)}, not the {what} it should be: move it away and run "
                           "again (nothing was written through it)") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise RunError(f"{path} is {kind(mode)}, not the {what} it should be: move it away and run again "
                       "(nothing was written through it)")
    os.set_blocking(fd, True)
    return fd


def open_lock(path: Path, what: str = "lock file") -> tuple[int, bool]:
    """A lock file opened read-write (made if absent, O_EXCL): (descriptor, this call made it)."""
    try:
        return _open_regular(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, what), True
    except FileExistsError:
        return _open_regular(path, os.O_RDWR, what), False


def open_append(path: Path, what: str) -> int:
    """A file opened for appending (made if absent). A file with more than one hard link (a run
    copied with `cp -al`) is copied first, so that the other names keep their content."""
    fd = _open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, what)
    if os.fstat(fd).st_nlink > 1:
        os.close(fd)
        write_file(path, Path(path).read_bytes())  # a file of its own under this name
        fd = _open_regular(path, os.O_WRONLY | os.O_APPEND, what)
    return fd


def private_copy(path: Path) -> None:
    """Before rewriting a file in place: one with other hard links becomes a file of its own."""
    st = lstat(path)
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        write_file(path, Path(path).read_bytes())


def remove_ours(path: Path) -> bool:
    """Delete a file we wrote, by its name: only a regular file (or a link, itself): a directory or
    a special file by that name is not ours and is kept. True if it was deleted."""
    st = lstat(path)
    if st is None or not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        return False
    Path(path).unlink(missing_ok=True)
    return True


def remove_folder(folder: Path, names: list[str]) -> list[str]:
    """Delete folder `folder` entry by entry: the regular files `names` (ours), then the folder if
    nothing else is left. Returns what was left (the folder is kept then)."""
    folder = Path(folder)
    st = lstat(folder)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return []
    for name in names:
        if "/" not in name and name not in ("", ".", ".."):
            remove_ours(folder / name)
    left = sorted(p.name for p in folder.iterdir())
    if not left:
        folder.rmdir()
    return left


def make_folders(root: Path, relative: Path) -> Path:
    """`root / relative`, its missing folders created; every folder on the way below `root` must be
    a real folder, never a link (a link in a folder we own would carry our writes elsewhere)."""
    current = Path(root)
    for part in Path(relative).parts:
        current = current / part
        st = lstat(current)
        if st is None:
            try:
                current.mkdir()
            except FileExistsError:
                pass  # made at the same moment: checked below
            st = lstat(current)
        if st is None or not stat.S_ISDIR(st.st_mode):
            what = "nothing" if st is None else kind(st.st_mode)
            raise RunError(f"{current} is {what}, not a folder: refusing to write through it (a link would "
                           "carry the write outside); move it away and run again")
    return current


def expect_regular(path: Path, what: str) -> None:
    """Before any work: `path` is absent or a regular file we may write (never a link, a folder or
    a special file: writing there would go elsewhere, hang or fail late)."""
    st = lstat(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise RunError(f"{path} is {kind(st.st_mode)}, not the {what} it should be: move it away and run again "
                       "(nothing was written)")


def expect_folder(path: Path, what: str) -> None:
    """Before any work: `path` is absent or a real folder (not a link to one, not a file)."""
    st = lstat(path)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise RunError(f"{path} is {kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else 'a file'}, not the "
                       f"{what} it should be: move it away and run again (nothing was written)")


def create_new(path: Path) -> int:
    """A new file of ours (a temporary name): O_EXCL, never through a link; a descriptor to write."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def rename_over(tmp: Path, final: Path, what: str) -> None:
    """Give our finished temporary file `tmp` the name `final`, replacing only a regular file."""
    expect_regular(final, what)
    os.replace(tmp, final)
