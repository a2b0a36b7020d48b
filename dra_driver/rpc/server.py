"""gRPC on our HTTP/2 connections: unary and server-streaming methods on a unix socket.

A method is found by its path (`/v1.DRAPlugin/NodePrepareResources`, from the generated
service descriptors), its request parsed, its handler run in a task of its own, and its
answer framed as gRPC's length-prefixed messages with `grpc-status` trailers. The
caller's deadline (`grpc-timeout`) cancels the handler, as the peer's RST_STREAM does.
Whatever cannot be served is answered with a status that says what to fix: an unknown
method, a compressed or malformed message, one over 4 MiB.

It must not know HTTP/2 framing (connection.py) or what the methods do (the services).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import structlog
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from dra_driver.rpc import frames
from dra_driver.rpc.connection import Connection, Headers

log = structlog.get_logger(__name__)

MAX_MESSAGE = 4 << 20  # grpc's default limit for a received message
_PREFIX = 5  # compressed flag, 4-byte length


class Status(IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14


class RpcError(Exception):
    """Raised by a handler to answer with this status instead of a message."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Method:
    path: bytes
    request_type: type[Message]
    handler: Callable[[Any], Any]  # unary: async def (request) -> response; streaming: async generator
    streaming: bool


def service_methods(service: ServiceDescriptor, implementation: object) -> list[Method]:
    """Every method of `service`, answered by `implementation`'s method of the same name."""
    methods = []
    for m in service.methods:
        if m.client_streaming:
            raise ValueError(f"{m.full_name}: client streaming is not supported")
        methods.append(
            Method(
                path=f"/{service.full_name}/{m.name}".encode(),
                request_type=GetMessageClass(m.input_type),
                handler=getattr(implementation, m.name),
                streaming=m.server_streaming,
            )
        )
    return methods


class RpcServer:
    def __init__(self, methods: Iterable[Method], name: str) -> None:
        self._methods = {m.path: m for m in methods}
        self._name = name
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[Connection] = set()
        self._calls: dict[asyncio.Task[None], bool] = {}  # task -> streaming
        self._socket: tuple[Path, os.stat_result] | None = None  # as bound

    async def start(self, socket: Path, mode: int = 0o600) -> None:
        """Listen on `socket` (which must not exist) with `mode` set before the first accept."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._connection, str(socket), start_serving=False)
        os.chmod(socket, mode)
        self._socket = (socket, socket.stat())
        await self._server.start_serving()

    def _connection(self) -> Connection:
        conn = Connection(self, _PREFIX + MAX_MESSAGE, self._connections.discard)
        self._connections.add(conn)
        return conn

    async def stop(self, grace: float | None) -> None:
        """Remove the socket (the kubelet's watcher deregisters a plugin whose registration
        socket goes), refuse new calls, let unary calls finish for `grace` seconds (streams
        end at once: they would never finish by themselves), then cancel the rest and close."""
        self._remove_socket()
        if self._server is not None:
            self._server.close()
        if self._connections:
            await asyncio.wait([asyncio.create_task(c.go_away(timeout=1)) for c in self._connections])
        for task, streaming in list(self._calls.items()):
            if streaming:
                task.cancel(_STOPPING)
        if self._calls:
            await asyncio.wait(list(self._calls), timeout=grace or 0)
        for task in list(self._calls):
            task.cancel(_STOPPING)
        if self._calls:
            await asyncio.wait(list(self._calls), timeout=1)
        connections = list(self._connections)
        for conn in connections:
            conn.close()
        if connections:
            await asyncio.wait([conn.closed for conn in connections], timeout=1)

    def _remove_socket(self) -> None:
        """Unlink the socket we bound, unless another instance has bound a new one there."""
        if self._socket is None:
            return
        path, bound = self._socket
        self._socket = None
        with contextlib.suppress(FileNotFoundError):
            now = path.lstat()
            if (now.st_dev, now.st_ino) == (bound.st_dev, bound.st_ino):
                path.unlink()

    # -- the connection's Dispatcher ---------------------------------------------------

    def dispatch(
        self, conn: Connection, stream: int, headers: Headers, body: bytes | None
    ) -> asyncio.Task[None] | None:
        path = content_type = timeout = None
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = value
        if content_type is None or not content_type.startswith(b"application/grpc"):
            conn.send_headers(stream, frames.http_status(415), end_stream=True)
            return None
        path_text = (path or b"").decode(errors="replace")
        method = self._methods.get(path or b"")
        if method is None:
            log.warning("call of an unknown method", server=self._name, path=path_text)
            _refuse(conn, stream, Status.UNIMPLEMENTED, f"unknown method {path_text!r}")
            return None
        try:
            request = _request(method, body)
        except RpcError as e:
            log.warning("malformed call", server=self._name, path=path_text, error=str(e))
            _refuse(conn, stream, e.status, str(e))
            return None
        run = _stream_call if method.streaming else _unary_call
        task = asyncio.get_running_loop().create_task(run(conn, stream, method, request))
        self._calls[task] = method.streaming
        task.add_done_callback(self._calls.pop)
        if timeout is not None:
            seconds = _timeout_seconds(timeout)
            if seconds is not None:
                expiry = asyncio.get_running_loop().call_later(seconds, task.cancel, _DEADLINE)
                task.add_done_callback(lambda _: expiry.cancel())
        return task


def _request(method: Method, body: bytes | None) -> Message:
    if body is None:
        raise RpcError(Status.RESOURCE_EXHAUSTED, f"request message larger than {MAX_MESSAGE} bytes")
    if len(body) < _PREFIX:
        raise RpcError(Status.INVALID_ARGUMENT, "the call carries no request message")
    if body[0] != 0:
        raise RpcError(Status.UNIMPLEMENTED, "compressed messages are not supported; send them uncompressed")
    length = int.from_bytes(body[1:_PREFIX], "big")
    if length != len(body) - _PREFIX:
        raise RpcError(
            Status.INVALID_ARGUMENT,
            f"the call carries {len(body) - _PREFIX} bytes after a message prefix of {length} bytes; "
            "a unary call takes exactly one message",
        )
    try:
        return method.request_type.FromString(body[_PREFIX:])
    except DecodeError:
        name = method.request_type.DESCRIPTOR.full_name
        raise RpcError(Status.INVALID_ARGUMENT, f"cannot parse the request as a {name}") from None


async def _unary_call(conn: Connection, stream: int, method: Method, request: Message) -> None:
    handler: Callable[[Message], Awaitable[Message]] = method.handler
    try:
        response = await handler(request)
    except (asyncio.CancelledError, Exception) as e:
        # After a reset by the caller the stream is gone and this answer goes nowhere.
        _refuse(conn, stream, *_failure(e, method))
    else:
        conn.respond(stream, frames.GRPC_RESPONSE_HEADERS, _framed(response), _OK_TRAILERS)


async def _stream_call(conn: Connection, stream: int, method: Method, request: Message) -> None:
    handler: Callable[[Message], AsyncIterator[Message]] = method.handler
    started = False
    try:
        async for response in handler(request):
            if not started:
                conn.send_headers(stream, frames.GRPC_RESPONSE_HEADERS)
                started = True
            conn.send_data(stream, _framed(response))
            await conn.drained(stream)
    except (asyncio.CancelledError, Exception) as e:
        status, message = _failure(e, method)
    else:
        status, message = Status.OK, ""
    if started:
        conn.send_trailers(stream, _trailers(status, message))
    else:
        _refuse(conn, stream, status, message)


def _refuse(conn: Connection, stream: int, status: Status, message: str) -> None:
    """A trailers-only answer: the status and no message."""
    conn.send_headers(stream, frames.GRPC_RESPONSE_HEADERS + _trailers(status, message), end_stream=True)


_DEADLINE = "deadline exceeded"
_STOPPING = "the plugin is stopping; call again"


def _failure(e: BaseException, method: Method) -> tuple[Status, str]:
    """The status for a call that ended without its answer."""
    if isinstance(e, asyncio.CancelledError):  # the deadline, or the server stopping
        return (
            (Status.DEADLINE_EXCEEDED, _DEADLINE)
            if e.args == (_DEADLINE,)
            else (Status.UNAVAILABLE, _STOPPING)
        )
    if isinstance(e, RpcError):
        return e.status, str(e)
    log.exception("call failed", method=method.path.decode())
    return Status.UNKNOWN, f"{type(e).__name__}: {e}"


def _framed(message: Message) -> bytes:
    payload = message.SerializeToString()
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


_OK_TRAILERS = frames.hpack_literal(b"grpc-status", b"0")


def _trailers(status: Status, message: str) -> bytes:
    if status == Status.OK and not message:
        return _OK_TRAILERS
    block = frames.hpack_literal(b"grpc-status", str(int(status)).encode())
    if message:
        block += frames.hpack_literal(b"grpc-message", _percent_encode(message))
    return block


def _percent_encode(message: str) -> bytes:
    """gRPC's grpc-message encoding: printable ASCII except '%' as is, all else %XX."""
    return b"".join(
        bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}".encode() for b in message.encode()
    )


_UNITS = {ord("H"): 3600.0, ord("M"): 60.0, ord("S"): 1.0, ord("m"): 1e-3, ord("u"): 1e-6, ord("n"): 1e-9}


def _timeout_seconds(value: bytes) -> float | None:
    """grpc-timeout (`1-8 digits` + H/M/S/m/u/n) in seconds; None if malformed (no deadline)."""
    unit = _UNITS.get(value[-1]) if value else None
    digits = value[:-1]
    if unit is None or not 1 <= len(digits) <= 8 or not digits.isdigit():
        return None
    return int(digits) * unit
