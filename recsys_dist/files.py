"""Writing files so that a link planted where recsys_dist writes never redirects the write.

Every file recsys_dist writes into a run directory (``.lock``, ``config.yaml``, ``plan.txt``,
``plan.json``, ``metrics.jsonl``, ``summary.json``, a checkpoint's ``meta.json`` /
``checksums.json`` / ``preprocessing.json`` and the ``latest`` / ``best`` markers, the
report's plots, profiler traces), a publish directory (``manifest.json``, ``.lock``, each
version's files) or an export directory goes through this module:

- :func:`write_atomic`: a whole file. It is written under a new name in the same directory
  (created with ``O_CREAT | O_EXCL | O_NOFOLLOW``: never an existing file or link), synced to
  disk, then renamed over the target (``os.replace``). ``rename(2)`` replaces the directory
  entry itself, so a symbolic link at the target is replaced by the new file and whatever it
  pointed at is never opened; a reader sees the old file or the new one, never half of one.
  The file gets the mode of a plain ``open`` (0666 less the umask), whatever the writer
  chose (safetensors writes 0600): a server running as another user reads it.
- :func:`open_in_place`: a file written where it is (a lock, an appended log), opened with
  ``O_NOFOLLOW``. A symbolic link, a file with another hard link, or anything but a regular
  file is refused with :class:`~recsys_dist.errors.UnsafeFile` (naming the path and the fix).
- :func:`fresh_dir`: a new empty directory where a stale one (or a link) may be.
- :func:`refuse_planted`: the check a run makes before it starts: a directory (or, for a file
  written in place, a link) at a name it will write is refused up front, naming the fix,
  instead of failing once the run has trained.

Links among the directories above the file (a run directory on another disk, reached through
a symbolic link) are followed as usual: only the file's own name is never a link.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from recsys_dist.errors import UnsafeFile  # noqa: F401 (raised here; defined in errors)

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def write_atomic(path: str | os.PathLike, data: str | bytes | Callable[[Path], object]) -> Path:
    """Replace ``path`` by a new file holding ``data`` (a str is written as UTF-8), atomically.

    ``data`` may instead be a function that writes the file at the path it is given (for
    writers that take a path: ``safetensors``, ``torch.jit``, matplotlib); that path is a new,
    empty regular file in the same directory, named ``.NAME.RANDOM.tmp``. The new file is
    fsynced before the rename and the directory after it. A symbolic link (or any other file)
    at ``path`` is replaced, never written through; the file gets the mode of a plain
    ``open`` (0666 less the umask), also when the function's writer chose another (safetensors
    writes 0600, which a server running as another user could not read).

    Returns:
        ``path``.

    Raises:
        UnsafeFile: ``path`` is a directory (errno ``EISDIR``; nothing is written).
        OSError: the directory cannot be written (the temporary file is removed; ``path`` is
            left as it was).
    """
    path = Path(path)
    refuse_planted(path)  # before writing: a directory there would fail only at the rename
    tmp, fd = _new_temp(path)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)  # 0666 less the umask, as the kernel applied it
        if callable(data):
            os.close(fd)
            fd = -1
            data(tmp)
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # to fsync what the writer wrote
            if stat.S_IMODE(os.fstat(fd).st_mode) != mode:  # the writer replaced the file with its own
                os.fchmod(fd, mode)
        else:
            view = memoryview(data.encode() if isinstance(data, str) else data)
            while view:  # os.write may write less than asked (a signal, a pipe-like file system)
                view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        try:
            os.replace(tmp, path)
        except IsADirectoryError:  # a directory made there meanwhile
            raise UnsafeFile(path, "a directory") from None
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    _sync_dir(path.parent)
    return path


def open_in_place(path: str | os.PathLike, flags: int, mode: int = 0o666) -> int:
    """``os.open(path, flags, mode)`` for a file written in place, refusing anything but one
    plain file of its own: the descriptor is opened with ``O_NOFOLLOW`` (and ``O_CLOEXEC``).

    Returns:
        The descriptor (blocking, as ``os.open`` gives it).

    Raises:
        UnsafeFile: ``path`` is a symbolic link, a file with more than one hard link, or not a
            regular file (a FIFO, a device, a directory); nothing was written.
        OSError: ``path`` cannot be opened for another reason (missing directory, permissions).
    """
    path = Path(path)
    try:
        # O_NONBLOCK: a FIFO planted here is refused below instead of blocking the open.
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError:
        what = _not_plain(path)
        if what:
            raise UnsafeFile(path, what) from None
        raise
    st = os.fstat(fd)
    what = _describe(st, path) if not stat.S_ISREG(st.st_mode) else None
    if what is None and st.st_nlink > 1:
        what = f"a file with {st.st_nlink} hard links (other names for the same data, which a write here would change)"
    if what:
        os.close(fd)
        raise UnsafeFile(path, what)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def refuse_planted(path: str | os.PathLike, in_place: bool = False) -> None:
    """Refuse what stands at ``path`` where recsys_dist will write a file: a directory (which
    :func:`write_atomic` cannot replace), and, for a file written in place (``in_place``:
    :func:`open_in_place`), also a symbolic link or anything but a regular file. Nothing there,
    a regular file, or (not ``in_place``) a link is fine.

    Raises:
        UnsafeFile: naming the path, what it is and the fix (``rm -r PATH`` for a directory).
    """
    path = Path(path)
    what = _not_plain(path)
    if what == "a directory" or (what and in_place):
        raise UnsafeFile(path, what)


def fresh_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` as a new empty directory (and its parents), removing what was there
    first: a directory with its contents, a file, or a symbolic link (the link itself, never
    what it points at). Returns ``path``.

    Raises:
        OSError: it cannot be removed or created (``FileExistsError``: something was created
            there meanwhile).
    """
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    elif st is not None:
        path.unlink()
    path.mkdir(parents=True)
    return path


def _new_temp(path: Path) -> tuple[Path, int]:
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return tmp, os.open(tmp, _NEW, 0o666)
        except FileExistsError:
            continue
        except OSError as err:  # named after the file asked for, not its temporary name
            raise OSError(err.errno, err.strerror, str(path)) from None
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))


def _sync_dir(directory: Path) -> None:
    """fsync a directory, so that a rename in it survives a power cut; a file system that
    cannot (some network and FUSE ones) is left to its own guarantees."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _not_plain(path: Path) -> str | None:
    """What ``path`` is when it is there and not a regular file, else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return None if stat.S_ISREG(st.st_mode) else _describe(st, path)


def _describe(st: os.stat_result, path: Path) -> str:
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket"}
    return next((v for test, v in kinds.items() if test(st.st_mode)), "not a regular file (a device?)")
