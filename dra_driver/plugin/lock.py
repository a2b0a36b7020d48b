"""File locks that let two plugin instances on one node take turns (a rolling update).

During an update the old and the new plugin pod run side by side over one state dir, and
the kubelet may send either of them a call. `exclusive` serializes every checkpoint
transaction across processes AND threads: each use opens the lock file anew, and `flock`
locks belong to the open file, so two opens conflict even inside one process. The kernel
drops a lock when its holder dies, so a kill -9 never leaves the node locked.

`Lease` is the non-blocking kind, held for a process's life: the one instance that holds
it publishes the node's ResourceSlices. Neither kind ever reads or writes the files they
guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for the `with` block; blocks
    until it is free (so it runs in a worker thread, never on the event loop)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor of the open file releases the lock


class Lease:
    """An exclusive lock on `path` that one process takes without waiting and keeps."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it; True if this process holds it now."""
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    async def wait_held(self, poll: float, waiting: Callable[[], None] | None = None) -> None:
        """Poll until this process holds the lease; `waiting()` once if it has to wait (the
        holder, another instance, releases it when it exits, or the kernel when it dies)."""
        if self.try_acquire():
            return
        if waiting is not None:
            waiting()
        while not self.try_acquire():
            await asyncio.sleep(poll)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
