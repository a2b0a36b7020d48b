"""Crash-safe file replacement, shared by the CDI spec writer, the checkpoint and MPS settings."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes, mode: int = 0o644, durable: bool = True) -> None:
    """Replace `path` with `data` so that a reader or a crash sees the old file or the new
    one, never a part: temp file in the same directory, fsync, rename, fsync the directory.
    `durable=False` leaves out both fsyncs: readers and a crashed process still see whole
    files (the page cache survives the process), only a crash of the machine may not.

    The temp name starts with '.' and ends in '.tmp', so CDI runtimes (which read only
    *.json and *.yaml) never pick it up."""
    path = Path(path)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{path.name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
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
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(directory)
