"""grpcio's asyncio servers on the kubelet's unix sockets.

A socket appears at its path only once it serves and has its mode: grpcio binds a hidden
name beside it (the kubelet's plugin watcher ignores names that start with a dot), and the
bound socket is then renamed into place, so the kubelet never dials a socket that is not
ready. On stop the socket is removed first (the kubelet's watcher deregisters a plugin
whose registration socket goes), but only if it is still the one this server bound: during
a rolling update a newer instance may have bound its own socket at that path meanwhile.
Calls already on their way are then served for the grace period; grpcio's graceful
shutdown (GOAWAY, then the final GOAWAY) refuses only new ones.

It must not know what the services do (service.py, registration.py) and must not speak
HTTP/2 itself: the protocol is grpcio's.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog

from dra_driver.plugin.sockets import SOCKET_MODE, prepare_socket_path

log = structlog.get_logger(__name__)

Register = Callable[[grpc.aio.Server], None]
_serial = itertools.count()


class SocketServer:
    """One grpc.aio server on one unix socket."""

    def __init__(self, name: str, register: Register) -> None:
        self.name = name
        self._server = grpc.aio.server()
        register(self._server)
        self._bound: tuple[Path, int, int] | None = None  # path, st_dev, st_ino

    async def start(self, socket: Path) -> None:
        prepare_socket_path(socket)
        hidden = socket.parent / f".{os.getpid()}-{next(_serial)}.sock"
        with contextlib.suppress(FileNotFoundError):
            hidden.unlink()
        self._server.add_insecure_port(f"unix://{hidden}")
        await self._server.start()
        os.chmod(hidden, SOCKET_MODE)
        os.rename(hidden, socket)
        st = socket.lstat()
        self._bound = (socket, st.st_dev, st.st_ino)
        log.info("serving", server=self.name, socket=str(socket))

    async def stop(self, grace: float | None) -> None:
        """Remove our socket, refuse new calls, let those in flight finish for `grace` s."""
        self._remove_socket()
        await self._server.stop(grace)

    def _remove_socket(self) -> None:
        if self._bound is None:
            return
        path, dev, ino = self._bound
        self._bound = None
        with contextlib.suppress(FileNotFoundError):
            now = path.lstat()
            if (now.st_dev, now.st_ino) == (dev, ino):
                path.unlink()
