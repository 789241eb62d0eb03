"""File-system edges every command shares: atomic writes (of a file, or of a whole folder),
outputs that never replace a file, paths confined to their root, temporary names whose leftovers
a later run can clean, and refusing S3 where only a local path makes sense.

A result either appears whole under its final name or not at all: it is written to a temporary
file in the same folder and renamed; on any failure the temporary file is removed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import sys
from pathlib import Path

from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.values import shown
from neuron_train.common.writer import (
    Target,
    probe_output,
    refuse_kernel_fs,
    remove_folder,
    write_file,
)
from neuron_train.common.writer import lstat as writer_lstat


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_bytes_atomic(path: Path | Target, data: bytes) -> Path:
    """Write `data` to `path` whole or not at all, by the writer's rules (`common.writer.write_file`:
    temp file in the same folder, fsync, rename; only a regular file replaced); the path written."""
    return write_file(path, data)


def write_failed(path: Path, exc: OSError, kept: str = "") -> RunError:
    """The one line for a write that failed (raise it `from None`): a full disk says so, with the
    space left; `kept` says what is still intact (", the previous one is kept")."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        folder = Path(path).parent
        while not folder.is_dir() and folder != folder.parent:
            folder = folder.parent
        free = shutil.disk_usage(folder).free / 2**20
        return RunError(f"no space left on the device of {path} ({free:.1f} MiB free): it was not "
                        f"written{kept}; free some space and run again")
    return RunError(f"cannot write {path}: {exc.strerror or exc}{kept}")


# errno -> what is wrong with a path the user gave, whatever the command and whatever it does with it
_UNUSABLE = {
    errno.ENAMETOOLONG: "is too long (at most 4095 bytes, and 255 for each name in it): give a shorter path",
    errno.ELOOP: "goes through a loop of symbolic links: fix the link or give another path",
    errno.ENOTDIR: "goes through a file as if it were a folder: check the path",
    errno.EACCES: "cannot be used: permission denied: fix its permissions or choose another location",
    errno.EPERM: "cannot be used: operation not permitted: choose another location",
    errno.EROFS: "is on a read-only file system: remount it read-write or choose another location",
}
_SYMLINK_LOOP = "Symlink loop from "  # Path.resolve() raises RuntimeError, not OSError(ELOOP), before 3.13


def unusable_path(exc: BaseException, flag: str = "") -> UsageError | None:
    """The one line for a path that cannot be used at all (too long, a symlink loop, a file where
    a folder should be, permission denied), found where any command first touches it; None for
    any other error. `flag` names the option the path was given with."""
    if isinstance(exc, OSError) and exc.errno in _UNUSABLE and exc.filename is not None:
        path, problem = os.fsdecode(exc.filename), _UNUSABLE[exc.errno]
    elif type(exc) is RuntimeError and str(exc).startswith(_SYMLINK_LOOP):
        path, problem = str(exc)[len(_SYMLINK_LOOP):].strip("'"), _UNUSABLE[errno.ELOOP]
    else:
        return None
    return UsageError(f"{flag + ': ' if flag else ''}path {shown(path)} {problem}")


def refuse_unusable(path: str | os.PathLike, flag: str, but: int = 0) -> None:
    """Refuse a path no command can use (`unusable_path`) before any work is done; a path that
    does not exist yet is fine. `but`: an errno the caller explains itself."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno != but and (usage := unusable_path(exc, flag)) is not None:
            raise usage from None


def write_text_atomic(path: Path | Target, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path | Target, data: dict) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def new_output(value: str | os.PathLike, flag: str, replace: bool = False, create_folder: bool = False) -> Target:
    """An output file the command will create: refused before any work if it exists or cannot be
    written (a previous result may be someone's record; a late failure would lose the measurement).
    With `replace` (the command's --force) an existing regular file is allowed, never a directory,
    a link or a special file (`common.writer.probe_output`); with `create_folder` a missing folder
    is allowed when it can be created (the caller creates it). Write it with `write_json_atomic`:
    the probe is re-checked then."""
    path = Path(value)
    refuse_unusable(path, flag, but=errno.ENOTDIR)  # a path under a file: said below, naming the file
    if path.is_dir():
        raise UsageError(f"{flag}: {path} is a directory: give a file name")
    target = probe_output(path, flag, replace)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir() and not create_folder:
        raise UsageError(f"{flag}: folder {parent} does not exist: create it first")
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the folder that the missing ones will be created in
    if not parent.is_dir():
        raise UsageError(f"{flag}: {parent} is not a folder: choose another location")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: folder {parent} is not writable: choose another location")
    refuse_kernel_fs(parent, flag)
    _probe(parent, path, flag)
    return target


def _probe(folder: Path, path: Path, flag: str) -> None:
    """Create and remove a file in `folder`: what permissions do not say (a read-only mount, /proc,
    a full disk of inodes, root's os.access answering yes) is found before the work, not after."""
    probe = work_path(folder / path.name, "probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        raise UsageError(f"{flag}: cannot create {path.name} in {folder}: {exc.strerror or exc}: choose another "
                         "location") from None
    probe.unlink(missing_ok=True)


def write_json_or_print(output: Target | Path, data: dict, hint: str) -> Path:
    """Write a measurement whole (`write_json_atomic`, its folder created); if that still fails, it
    is printed rather than lost, and the line says so (`hint`: what to do with the printed JSON).
    Returns the path written (beside the probed one if a file appeared there meanwhile)."""
    path = output.path if isinstance(output, Target) else Path(output)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_json_atomic(output, data)
    except OSError as exc:
        print(json.dumps(data, indent=2), flush=True)
        raise RunError(f"cannot write {path}: {exc.strerror or exc}; the result is printed above ({hint})") from None


def not_utf8(path: Path, exc: UnicodeDecodeError) -> UsageError:
    """The one line for a text input that is not UTF-8 (raise it `from None`)."""
    return UsageError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}): "
                      "save it as UTF-8")


def short(where: str) -> str:
    """A path under the current folder, relative: easier to read, still clickable (the checker's
    source lines, precompile's and bench's)."""
    cwd = os.getcwd() + os.sep
    return where[len(cwd):] if where.startswith(cwd) else where


def is_s3(location: str) -> bool:
    return str(location).startswith("s3://")


def confined(root: Path, relative: str, what: str) -> Path:
    """`root / relative`, refused unless it resolves inside `root` (a path read from a manifest,
    an archive or a result file must never reach outside the folder it belongs to)."""
    if not isinstance(relative, str) or not relative or "\x00" in relative:
        raise UsageError(f"{what}: {relative!r} is not a relative path")
    candidate = Path(relative)
    base = Path(root).resolve()
    target = (base / candidate).resolve()
    if candidate.is_absolute() or (target != base and base not in target.parents):
        raise UsageError(f"{what}: {relative!r} points outside {root}: refusing it")
    return target


def work_path(final: Path, kind: str) -> Path:
    """A temporary name beside `final` owned by this process: `.NAME.KIND-HOST-PID`.

    The host and process id let a later run tell a dead writer's leftover from a live one's
    (`stale_work_paths`); the leading dot keeps it out of the way.
    """
    final = Path(final)
    return final.with_name(f".{final.name}.{kind}-{socket.gethostname()}-{os.getpid()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def stale_work_paths(final: Path, kind: str) -> list[Path]:
    """`work_path`s of `final` left by processes of this host that are gone (killed, crashed)."""
    final = Path(final)
    pattern = re.compile(re.escape(f".{final.name}.{kind}-{socket.gethostname()}-") + r"(\d+)")
    if not final.parent.is_dir():
        return []
    return sorted(p for p in final.parent.iterdir()
                  if (m := pattern.fullmatch(p.name)) and not _pid_alive(int(m.group(1))))


def remove_path(path: Path) -> None:
    """Delete a file, a symbolic link or a folder tree (never following a link)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


LISTED = ".neuron-train-files"  # in a folder `publish_folder` made: the names it wrote there, one a line


def _listed(folder: Path, known: tuple[str, ...]) -> list[str]:
    """The names a published folder holds by its own list (`known`: for a folder made before the
    list existed), with the temporary files of their writes."""
    listing = folder / LISTED
    st = writer_lstat(listing)
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_size <= 1 << 16:
        names = listing.read_text(encoding="utf-8", errors="replace").splitlines() + [LISTED]
    else:
        names = list(known)
    temps = [p.name for p in folder.iterdir() for n in names if p.name.startswith(f".{n}.") and p.name.endswith(".tmp")]
    return names + temps


def drop_folder(folder: Path, known: tuple[str, ...] = ()) -> list[str]:
    """Delete a folder `publish_folder` made, entry by entry (only the names it lists, regular files);
    what else is in it is kept with the folder. Returns what was kept."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    return remove_folder(folder, _listed(folder, known))


def recover_folder(out: Path, known: tuple[str, ...] = ()) -> None:
    """Clean up after a `publish_folder` of `out` killed on this host: a half-built folder is
    deleted; an old folder moved aside is put back if the swap never finished, else deleted
    (entry by entry: `drop_folder`)."""
    out = Path(out)
    for stale in stale_work_paths(out, "building"):
        drop_folder(stale, known)
    for stale in stale_work_paths(out, "old"):
        if out.exists() or out.is_symlink():
            drop_folder(stale, known)
        else:
            os.rename(stale, out)


def publish_folder(out: Path, files: dict[str, bytes], known: tuple[str, ...] = ()) -> None:
    """Make folder `out` hold exactly `files` (name -> bytes) and their list (`LISTED`), whole or
    not at all.

    The files are written into a folder beside `out`, which then takes its name; an existing `out`
    is moved aside first and deleted after, entry by entry (`drop_folder`; `known`: the names an
    old folder without a list may hold). A failure or a crash leaves the old folder or the new
    one, never a mix of both (`recover_folder` finishes the job after a killed process).
    """
    out = Path(out)
    try:
        _publish(out, files, known)
    except OSError as exc:  # a full disk, a folder gone read-only: nothing changed
        raise write_failed(out, exc, kept=" (the previous folder, if any, is kept as it was)") from None


def _publish(out: Path, files: dict[str, bytes], known: tuple[str, ...]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    build, old = work_path(out, "building"), work_path(out, "old")
    build.mkdir()
    try:
        write_bytes_atomic(build / LISTED, "".join(name + "\n" for name in files).encode())
        for name, data in files.items():
            write_bytes_atomic(build / name, data)
        if not out.exists():
            os.rename(build, out)
            return
        os.rename(out, old)
        try:
            os.rename(build, out)
        except BaseException:
            os.rename(old, out)  # put the old folder back
            raise
        kept = drop_folder(old, known)
        if kept:
            print(f"note: {old} is kept: it holds {', '.join(kept[:3])}, which this command did not write",
                  file=sys.stderr, flush=True)
    finally:
        drop_folder(build)
