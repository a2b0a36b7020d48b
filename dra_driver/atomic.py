"""Crash-safe file replacement, shared by the CDI spec writer, the checkpoint and MPS settings."""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
from pathlib import Path

# Temp names unique across processes (two plugin instances share a directory; in their
# containers both may be pid 1) and within one, without a random draw per write.
_TOKEN = secrets.token_hex(4)
_SEQUENCE = itertools.count()


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(
    path: str | os.PathLike[str], data: bytes, mode: int = 0o644, durable: bool = True
) -> None:
    """Replace `path` with `data` so that a reader or a crash sees the old file or the new
    one, never a part: temp file in the same directory, fsync, rename, fsync the directory.
    `durable=False` leaves out both fsyncs: readers and a crashed process still see whole
    files (the page cache survives the process), only a crash of the machine may not.
    The directory is created if missing.

    The temp name starts with '.' and ends in '.tmp', so CDI runtimes (which read only
    *.json and *.yaml) never pick it up."""
    # Plain strings rather than pathlib: this runs on every Prepare and Unprepare.
    target = os.fspath(path)
    directory, name = os.path.split(target)
    tmp = os.path.join(directory, f".{name}.{_TOKEN}{next(_SEQUENCE)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, mode)
    except FileNotFoundError:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(tmp, flags, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(Path(directory))
