"""A minimal HTTP/1.1 client over asyncio streams, for talking to the Kubernetes API server.

It sends requests with a body of known length, reads responses framed by Content-Length,
by chunked encoding or by the connection's end, reuses keep-alive connections from a
bounded pool, and streams a body line by line (a watch). It must not grow into a general
client: no proxies, redirects, compression, cookies or HTTP/2, none of which the API server
needs. It exists because aiohttp costs the node daemon ~12 MiB of RSS and ~0.2 s of
start-up for what is here a hundred lines (dra_driver.kube says more).

Errors: a connection that breaks raises `ConnectionError` (an OSError); a timeout raises
`TimeoutError`. A connection is returned to the pool only after its response was read in
full; any failure closes it.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
LINE_LIMIT = 1 << 16  # the status line and headers together, or a chunk-size line
_Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class ProtocolError(ConnectionError):
    """The server's answer is not HTTP/1.1 as this client reads it."""


@dataclass(frozen=True)
class Response:
    status: int
    reason: str
    headers: Mapping[str, str]  # names in lower case
    body: bytes


class Body:
    """A response body being read from its connection."""

    def __init__(self, reader: asyncio.StreamReader, headers: Mapping[str, str]) -> None:
        self._reader = reader
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        if length is not None and not length.isdigit():
            raise ProtocolError(f"not a Content-Length: {length[:100]!r}")
        self._left: int | None = int(length) if length is not None and not self._chunked else None
        self.complete = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; `complete` once all of it was read."""
        if self._chunked:
            while True:
                size_line = await self._reader.readline()
                if not size_line.endswith(b"\n"):
                    raise ConnectionError("the connection closed in the middle of a chunked body")
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolError(f"not a chunk size line: {size_line[:100]!r}") from None
                if size == 0:
                    while (await self._reader.readline()).strip():  # trailers
                        pass
                    break
                data = await self._reader.readexactly(size + 2)
                yield data[:-2]
        elif self._left is not None:
            while self._left > 0:
                data = await self._reader.read(min(self._left, 1 << 20))
                if not data:
                    raise ConnectionError(f"the connection closed with {self._left} bytes of the body unread")
                self._left -= len(data)
                yield data
        else:  # no framing: the body ends with the connection
            while data := await self._reader.read(1 << 20):
                yield data
        self.complete = True

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def lines(self) -> AsyncIterator[bytes]:
        """The body split at newlines (each line without it): a watch's events."""
        pending = b""
        async for chunk in self.chunks():
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line
        if pending:
            yield pending


class ConnectionPool:
    """Keep-alive connections to one server, at most `limit` in use at once."""

    def __init__(self, host: str, port: int, ssl_context: ssl.SSLContext | None, limit: int = 64) -> None:
        self.host, self.port, self.ssl_context = host, port, ssl_context
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(limit)

    async def _connect(self) -> _Connection:
        if self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
            return await self._connect()
        return await asyncio.open_connection(
            self.host.strip("[]"),
            self.port,
            ssl=self.ssl_context,
            server_hostname=self.host.strip("[]") if self.ssl_context else None,
            limit=LINE_LIMIT,
        )

    def _head(self, method: str, target: str, headers: Mapping[str, str], body: bytes | None) -> bytes:
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    @asynccontextmanager
    async def stream(
        self, method: str, target: str, headers: Mapping[str, str], body: bytes | None = None
    ) -> AsyncIterator[tuple[int, str, dict[str, str], Body]]:
        """Send a request; yield (status, reason, headers, body) with the body still unread.

        A reused connection that the server had closed meanwhile is retried once on a new
        one when the method is idempotent and no byte of an answer came back.
        """
        async with self._slots:
            for attempt in (1, 2):
                reused = bool(self._idle)
                reader, writer = await self._connect()
                try:
                    writer.write(self._head(method, target, headers, body) + (body or b""))
                    await writer.drain()
                    head = await _read_head(reader)
                except (ConnectionError, ssl.SSLError):
                    writer.close()
                    if reused and attempt == 1 and method in IDEMPOTENT:
                        continue
                    raise
                break
            try:
                status_line, *header_lines = head.split(b"\r\n")
                status, reason = _status(status_line)
                response_headers = _headers(header_lines)
                response_body = Body(reader, response_headers)
                yield status, reason, response_headers, response_body
            except BaseException:
                writer.close()
                raise
            if response_body.complete and response_headers.get("connection", "").lower() != "close":
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def request(
        self, method: str, target: str, headers: Mapping[str, str], body: bytes | None = None
    ) -> Response:
        async with self.stream(method, target, headers, body) as (status, reason, response_headers, payload):
            return Response(status, reason, response_headers, await payload.read())

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()


def _status(line: bytes) -> tuple[int, str]:
    parts = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError(f"not an HTTP/1.1 status line: {line[:100]!r}")
    return int(parts[1]), parts[2] if len(parts) > 2 else ""


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    """The status line and headers, without the blank line that ends them: one read, not
    one per line."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            raise ConnectionError("the server closed the connection without an answer") from None
        raise ConnectionError("the connection closed in the middle of the response headers") from None
    except asyncio.LimitOverrunError:
        raise ProtocolError(f"response headers longer than {LINE_LIMIT} bytes") from None
    return head[:-4]


def _headers(lines: list[bytes]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        text = line.decode("latin-1")
        name, sep, value = text.partition(":")
        if not sep:
            raise ProtocolError(f"not an HTTP header line: {text[:100]!r}")
        headers[name.strip().lower()] = value.strip()
    return headers
