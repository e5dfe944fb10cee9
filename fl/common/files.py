"""Files on disk are data: what a run reads is a regular file of bounded size, and what it
writes is never written through a link.

A checkpoint, a history file, a saved command line or a trace that is a FIFO would block
the reader forever; a directory or a device in their place would fail far from the cause.
`open_regular` opens without blocking, checks what it opened (not the name, which could be
swapped in between), and refuses anything but a regular file of at most `max_bytes`.

Every file the project writes goes through `write_atomic` (or `open_for_append` for a log),
which refuse a link or a non-regular file at the name in one line instead of writing
through it: a link planted in a run folder cannot make a run write a shell start-up file.
"""

from __future__ import annotations

import io
import logging
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

from fl.common.errors import RunError

__all__ = [
    "TEXT_LIMIT",
    "LogFile",
    "NotRegularFile",
    "make_dir",
    "open_for_append",
    "open_regular",
    "read_regular_text",
    "require_regular",
    "require_writable",
    "write_atomic",
]

TEXT_LIMIT = 16 * 2**20  # a saved command line, a metrics file of a run, a trace


class NotRegularFile(RunError):
    """A path that must be a regular file is something else, or too large."""


def _kind(mode: int) -> str:
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket"}
    kinds |= {stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def open_regular(path: str | Path, *, max_bytes: int | None = None) -> BinaryIO:
    """`path` opened for binary reading, if it is a regular file of at most `max_bytes`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(f"{path} is {_kind(info.st_mode)}, not a regular file")
        if max_bytes is not None and info.st_size > max_bytes:
            raise NotRegularFile(f"{path} is {info.st_size} bytes, more than {max_bytes}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_text(path: str | Path, *, max_bytes: int = TEXT_LIMIT) -> str:
    """The UTF-8 text of a regular file of at most `max_bytes`."""
    with open_regular(path, max_bytes=max_bytes) as f:
        return f.read(max_bytes + 1).decode()


def require_regular(path: str | Path) -> None:
    """Raise NotRegularFile if something other than a regular file is at `path` (following
    links); nothing there is fine."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise NotRegularFile(f"{path} is {_kind(mode)}, not a regular file")


# --- the write side: every file the project writes goes through these ---------------------

Writer = Callable[[BinaryIO], object]


def _what(mode: int) -> str:
    return "a symbolic link" if stat.S_ISLNK(mode) else _kind(mode)


def _refuse_odd(dir_fd: int | None, name: str | Path, path: str | Path) -> bool:
    """Whether a regular file is at `name` (nothing there: False); anything else (a link, a
    FIFO, a directory) is refused in one line, never followed."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(mode):
        raise NotRegularFile(
            f"{path} is {_what(mode)}, not a regular file: nothing is written to it"
        )
    return True


def require_writable(path: str | Path) -> None:
    """Raise NotRegularFile if a link or anything but a regular file is at `path` (a file
    the run will write); nothing there is fine. A check up front, before any round: the
    writers themselves refuse the same when they write."""
    _refuse_odd(None, path, path)


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def make_dir(path: str | Path) -> Path:
    """`path` made (with its parents) and checked to be a directory itself, not a link to
    one elsewhere: a folder inside a run directory (`.hydra`, `checkpoints`) is the project's."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mode = os.lstat(path).st_mode
    if not stat.S_ISDIR(mode):
        raise NotRegularFile(f"{path} is {_what(mode)}, not a directory: nothing is written in it")
    return path


@contextmanager
def open_for_append(path: str | Path) -> Iterator[BinaryIO]:
    """`path` opened to append to (made if absent), if it is a regular file and not a link:
    `O_NOFOLLOW` relative to its directory's descriptor, the kind checked on what opened."""
    path = Path(path)
    dir_fd = _open_dir(path.parent)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(path.name, flags | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
        except OSError as err:  # ELOOP: a link; ENXIO: a FIFO nobody reads
            _refuse_odd(dir_fd, path.name, path)
            raise NotRegularFile(f"{path}: cannot be written ({err.strerror})") from None
    finally:
        os.close(dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(f"{path} is {_kind(info.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def write_atomic(
    path: str | Path, data: bytes | str | Writer, *, keep_previous: str | None = None
) -> None:
    """Write `data` (bytes, text, or a function that writes into the file) to `path`
    atomically, never through a link: a new temporary file `NAME.tmp` made with
    `O_EXCL | O_NOFOLLOW` beside it, synced, then renamed over `path`, all relative to the
    directory's descriptor. A link or anything but a regular file at `path`, at the
    temporary's name or at `keep_previous` is refused in one line (a regular temporary is
    what a kill left: replaced). `keep_previous`: the name the old `path` is kept under."""
    path = Path(path)
    tmp = path.name + ".tmp"
    dir_fd = _open_dir(path.parent)
    try:
        _refuse_odd(dir_fd, path.name, path)
        if keep_previous is not None:
            _refuse_odd(dir_fd, keep_previous, path.with_name(keep_previous))
        if _refuse_odd(dir_fd, tmp, path.with_name(tmp)):
            os.unlink(tmp, dir_fd=dir_fd)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o666, dir_fd=dir_fd)
        except FileExistsError:
            raise NotRegularFile(f"{path.with_name(tmp)} appeared while writing") from None
        try:
            with os.fdopen(fd, "wb") as f:
                if callable(data):
                    data(f)
                else:
                    f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
            if keep_previous is not None and _refuse_odd(dir_fd, path.name, path):
                os.replace(path.name, keep_previous, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class LogFile(logging.FileHandler):
    """Hydra's `run.log` handler, never writing through a link: a link or anything but a
    regular file there gets nothing (fl-run then refuses the run in one line, naming it)."""

    def _open(self) -> io.TextIOWrapper:
        try:
            with open_for_append(self.baseFilename) as f:
                fd = os.dup(f.fileno())
        except (NotRegularFile, OSError):
            return open(os.devnull, "a", encoding=self.encoding)
        return open(fd, "a", encoding=self.encoding, errors=self.errors)
