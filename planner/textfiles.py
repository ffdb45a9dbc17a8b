"""Reading the files a user names (a plan, a profile, a prompt, saved runs): regular files only.

A FIFO, a socket or a character device named where a file is expected would block a read forever
(or never end), so such a path is refused before it is opened. Pure: stat and read, nothing written.
"""

from __future__ import annotations

import errno
import os
import stat

# What each non-regular file type is called in messages, by its stat.S_IS* test.
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symlink"))


def file_kind(mode: int) -> str:
    """What a stat mode describes, in words ("a regular file", "a FIFO", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


class NotRegularFileError(OSError):
    """A path that exists but is no regular file; its strerror says what it is instead."""


def require_regular_file(path: str | os.PathLike[str], mode: int | None = None) -> None:
    """Raise NotRegularFileError (an OSError: callers' `except OSError` report it) unless `path` is a regular file
    (a symlink to one is fine); a missing path raises the usual FileNotFoundError."""
    mode = os.stat(path).st_mode if mode is None else mode
    if not stat.S_ISREG(mode):
        raise NotRegularFileError(errno.EINVAL, f"is {file_kind(mode)}, not a regular file", os.fspath(path))


def read_text(path: str | os.PathLike[str]) -> str:
    """A regular file's text (UTF-8); anything else raises OSError (or UnicodeDecodeError) without blocking."""
    require_regular_file(path)  # before opening: opening some devices has effects
    # O_NONBLOCK: a FIFO swapped in after the check opens without waiting for a writer, and fstat refuses it.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with open(fd, encoding="utf-8") as f:
        require_regular_file(path, os.fstat(fd).st_mode)
        return f.read()
