"""grpcio's asyncio servers on the kubelet's unix sockets.

A socket appears at its path only once it serves and has its mode: grpcio binds a hidden
name beside it (the kubelet's plugin watcher ignores names that start with a dot), and the
bound socket is then renamed into place, so the kubelet never dials a socket that is not
ready. On stop the socket is removed first (the kubelet's watcher deregisters a plugin
whose registration socket goes), but only if it is still the one this server bound: during
a rolling update a newer instance may have bound its own socket at that path meanwhile.
Calls already on their way are then served for the grace period; grpcio's graceful
shutdown (GOAWAY, then the final GOAWAY) refuses only new ones.

Bounded, per connection and in total, so that what clients send can neither grow the
daemon past its memory limit nor take the descriptors a Prepare needs: requests of at most
MAX_RECEIVE_BYTES; at most MAX_CONCURRENT_STREAMS calls at once per connection (a client
with more waits for a free stream); at most MAX_CONCURRENT_RPCS calls at once across all
connections (one more is answered RESOURCE_EXHAUSTED at once, before its body is read, and
the kubelet retries), so request bodies in flight never pass MAX_CONCURRENT_RPCS x
MAX_RECEIVE_BYTES; at most MAX_CONNECTIONS connections (grpcio closes one more: the
kubelet's connection keeps its place, and a new one past MAX_CONNECTIONS others is dialled
again by the kubelet's client until one of them goes); a connection with no call for
IDLE_CONNECTION_SECONDS is closed (the kubelet's client dials again when it next calls; the
health stream keeps its connection busy). A request must arrive whole within
REQUEST_ARRIVAL_SECONDS whatever deadline the call carries (the kubelet's is a few KiB on a
local socket): a body that never completes is ended with DEADLINE_EXCEEDED and its
buffered bytes released, instead of being held for as long as the call's deadline or the
connection lives; and a call that carries no deadline gets DEFAULT_DEADLINE_SECONDS in all
(a call with a deadline, as the kubelet's are, is ended by grpcio at its own). To bound the
request's arrival, every unary request is read through grpcio's streaming-request path
(the wire is the same) by a wrapper made once at registration, and decoded there: a
request that is not the method's protobuf message is refused with INVALID_ARGUMENT and
counted, one log line per UNDECODABLE_LOG_SECONDS with the count (no traceback per request).
`raise_open_files_limit` lifts the soft RLIMIT_NOFILE to the hard one, once at daemon start:
every idle connection holds a descriptor, and a Prepare needs a few more.

It must not know what the services do (service.py, registration.py) and must not speak
HTTP/2 itself: the protocol is grpcio's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import resource
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import grpc
import structlog

from dra_driver.plugin.sockets import SOCKET_MODE, prepare_socket_path

log = structlog.get_logger(__name__)

Register = Callable[[grpc.aio.Server], None]
_serial = itertools.count()

# A Prepare naming service.MAX_CLAIMS claims with the longest names is under 400 KiB.
MAX_RECEIVE_BYTES: Final = 512 * 2**10
MAX_CONCURRENT_RPCS: Final = 64  # per server, health streams included: 32 MiB of request bodies at most
# Per connection: no lower than the server's own cap. A client that opens its streams before it
# has read the server's SETTINGS gets REFUSED_STREAM for those past this limit (16 measured:
# 16 Prepares at once on a new connection from grpcio failed that way), a refusal the
# server-wide cap would not have made.
MAX_CONCURRENT_STREAMS: Final = MAX_CONCURRENT_RPCS
# per server (the kubelet holds one or two): both servers' and the metrics port's connections
# together leave a Prepare its descriptors even under a hard limit of 1024
MAX_CONNECTIONS: Final = 128
IDLE_CONNECTION_SECONDS: Final = 60.0
REQUEST_ARRIVAL_SECONDS: Final = 5.0
DEFAULT_DEADLINE_SECONDS: Final = 60.0  # the kubelet's own calls carry 45 s
UNDECODABLE_LOG_SECONDS: Final = 60.0


def raise_open_files_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit (a container's soft limit is often 1024, and
    each idle kubelet or probe connection holds a descriptor); returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open files limit", soft=soft, hard=hard, error=str(e))
            return soft, soft
    return soft, hard


class _Undecodable:
    """Requests that were not their method's message: counted, logged once per interval."""

    def __init__(self, interval: float = UNDECODABLE_LOG_SECONDS) -> None:
        self.interval = interval
        self.count = 0
        self._unlogged = 0
        self._logged_at = -1e9

    def seen(self, method: str, error: BaseException) -> None:
        self.count += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= self.interval:
            log.warning("refused requests that are not protobuf messages of their method",
                        count=self._unlogged, interval_seconds=self.interval, last_method=method,
                        last_error=f"{type(error).__name__}: {error}"[:200])
            self._logged_at, self._unlogged = now, 0


class _Bounded:
    """Stands in for the grpc.aio server while services register, to wrap their handlers."""

    def __init__(
        self, server: grpc.aio.Server, deadline: float, arrival: float, undecodable: _Undecodable
    ) -> None:
        self._server = server
        self._deadline = deadline
        self._arrival = arrival
        self._undecodable = undecodable

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None:
        self._server.add_generic_rpc_handlers(handlers)  # the generated code's fallback: unwrapped

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        wrapped = {name: self._wrap(f"/{service}/{name}", h) for name, h in handlers.items()}
        self._server.add_registered_method_handlers(service, wrapped)

    def _wrap(self, method: str, handler: Any) -> Any:
        if handler.request_streaming:
            return handler
        decode = handler.request_deserializer
        deadline, arrival, undecodable = self._deadline, self._arrival, self._undecodable

        async def request(context: grpc.aio.ServicerContext) -> Any:
            try:
                async with asyncio.timeout(arrival):
                    raw = await context.read()
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"{method}: the request did not arrive whole within {arrival:g} s")
            if raw is grpc.aio.EOF:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: no request message")
            try:
                return decode(raw) if decode is not None else raw
            except Exception as e:  # protobuf's DecodeError, or anything a decoder raises
                undecodable.seen(method, e)
                name = getattr(getattr(decode, "__self__", None), "__name__", "request")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{method}: the request is not a {name} message: {e}"[:500])

        async def timed_out(context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"{method}: no deadline was given and the call took more than {deadline:g} s")

        if not handler.response_streaming:
            inner = handler.unary_unary

            async def unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                if context.time_remaining() is not None:
                    return await inner(await request(context), context)
                try:
                    async with asyncio.timeout(deadline):
                        return await inner(await request(context), context)
                except TimeoutError:
                    await timed_out(context)

            return grpc.stream_unary_rpc_method_handler(
                unary, request_deserializer=None, response_serializer=handler.response_serializer)

        stream = handler.unary_stream

        async def streaming(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            # Only the request's arrival is bounded: the answer streams for as long as the caller keeps it.
            if context.time_remaining() is not None:
                first = await request(context)
            else:
                try:
                    async with asyncio.timeout(deadline):
                        first = await request(context)
                except TimeoutError:
                    await timed_out(context)
            async for answer in stream(first, context):
                yield answer

        return grpc.stream_stream_rpc_method_handler(
            streaming, request_deserializer=None, response_serializer=handler.response_serializer)


class SocketServer:
    """One grpc.aio server on one unix socket."""

    def __init__(
        self,
        name: str,
        register: Register,
        default_deadline: float = DEFAULT_DEADLINE_SECONDS,
        arrival: float = REQUEST_ARRIVAL_SECONDS,
    ) -> None:
        self.name = name
        self._server = grpc.aio.server(maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS, options=[
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
            ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
            ("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS),
            ("grpc.max_connection_idle_ms", int(IDLE_CONNECTION_SECONDS * 1000)),
        ])
        self.undecodable = _Undecodable()
        register(_Bounded(self._server, default_deadline, arrival, self.undecodable))
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
