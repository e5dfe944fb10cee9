"""Files a run reads but did not just write: regular files only, each with a size bound.

A checkpoint, a history file, a saved command line or a trace that is a FIFO would block
the reader forever; a directory or a device in their place would fail far from the cause.
`open_regular` opens without blocking, checks what it opened (not the name, which could be
swapped in between), and refuses anything but a regular file of at most `max_bytes`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from fl.common.errors import RunError

__all__ = ["TEXT_LIMIT", "NotRegularFile", "open_regular", "read_regular_text", "require_regular"]

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
