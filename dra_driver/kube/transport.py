"""HTTP/1.1 to one API server: keep-alive connections over asyncio streams, h11 for the protocol.

`Pool.send` writes one request on an idle connection (or a new one, at most `size` open at
once: a request past them waits for a free one) and returns the `Response` as soon as its
head has arrived; the caller reads the body chunk by chunk (`Response.chunks`) and leaves
`async with response`, which puts the connection back when the answer was read to its end
and both sides may go on, and closes it otherwise.

Why h11 and not aiohttp: h11 is the HTTP/1.1 state machine (framing, chunked bodies,
keep-alive rules) with no I/O of its own, next to nothing in memory once imported; aiohttp's
client cost every node resident memory and start CPU (docs/install.md, "What the plugin
costs a node") for one peer that speaks JSON. Not http.client: it blocks, and the daemon is
asyncio throughout.

It must NOT parse HTTP itself (h11 does), retry or time out (`dra_driver.kube` decides,
inside the caller's deadline), follow redirects, read proxy variables, or know what a
Kubernetes object is.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Final

import h11

MAX_HEAD_BYTES: Final = 64 * 2**10  # a response's status line and headers
READ_CHUNK: Final = 2**16
IDLE_SECONDS: Final = 30.0  # an idle connection older than this is closed, not reused


class CouldNotConnect(ConnectionError):
    """The connection could not be opened: the request never left, so any method may repeat it."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.http = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.idle_since = time.monotonic()

    def reusable(self) -> bool:
        """Not closed by the server while idle, and not idle for too long."""
        return (
            not self.reader.at_eof()
            and not self.writer.is_closing()
            and time.monotonic() - self.idle_since < IDLE_SECONDS
        )

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # its event loop has ended
            self.writer.close()

    async def next_event(self) -> h11.Event:
        """The next event of the answer; ConnectionError where the answer breaks off or is not
        HTTP the way h11 reads it."""
        while True:
            try:
                event = self.http.next_event()
            except h11.RemoteProtocolError as e:
                raise ConnectionError(f"the API server's answer is not valid HTTP/1.1: {e}") from e
            if event is h11.NEED_DATA:
                self.http.receive_data(await self.reader.read(READ_CHUNK))  # b"": the server closed
                continue
            if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                raise ConnectionError("the API server closed the connection before the answer ended")
            assert isinstance(event, h11.Event)
            return event


class Response:
    """An answer whose head has arrived; the body is read with `chunks`."""

    def __init__(
        self, pool: Pool, slots: asyncio.Semaphore, connection: _Connection, head: h11.Response
    ) -> None:
        self.status = head.status_code
        self.reason = head.reason.decode("latin-1")
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers}  # names lower-case
        length = self.headers.get("content-length", "")
        self.content_length = int(length) if length.isdigit() else None
        self._pool = pool
        self._slots = slots
        self._connection: _Connection | None = connection
        self._ended = False
        self._keep = True

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, in pieces of at most READ_CHUNK bytes."""
        while not self._ended and self._connection is not None:
            event = await self._connection.next_event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._ended = True

    def close(self) -> None:
        """Do not read the rest: the connection goes with it when the response is released."""
        self._keep = False

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def release(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._pool.release(connection, self._slots, reuse=self._ended and self._keep)


class Pool:
    """At most `size` connections to `host:port`, over TLS when `tls` is a context."""

    def __init__(
        self, host: str, port: int, tls: ssl.SSLContext | None, server_hostname: str | None, size: int
    ) -> None:
        self.host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.address = (host, port)
        self._tls = tls
        self._server_hostname = (server_hostname or host) if tls is not None else None
        self._size = size
        self._idle: list[_Connection] = []
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _for_this_loop(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._loop is not loop:
            # Connections and waiters belong to the loop that made them (a CLI may run several).
            for connection in self._idle:
                connection.close()
            self._idle, self._slots, self._loop = [], asyncio.Semaphore(self._size), loop
        return self._slots

    async def send(
        self, method: str, target: str, headers: Sequence[tuple[str, str]], body: bytes | None
    ) -> Response:
        """Write one request and wait for its answer's head; the caller releases the response."""
        slots = self._for_this_loop()
        await slots.acquire()
        connection: _Connection | None = None
        try:
            connection = await self._connection()
            fields = [("Host", self.host_header), *headers]
            if body is not None:
                fields.append(("Content-Length", str(len(body))))
            events = [h11.Request(method=method, target=target, headers=fields),
                      *([h11.Data(data=body)] if body else []), h11.EndOfMessage()]
            connection.writer.write(b"".join(connection.http.send(e) or b"" for e in events))
            await connection.writer.drain()
            while not isinstance(head := await connection.next_event(), h11.Response):
                pass  # a 1xx (InformationalResponse) comes before the answer
            return Response(self, slots, connection, head)
        except BaseException:
            if connection is not None:
                connection.close()
            slots.release()
            raise

    async def _connection(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable():
                return connection
            connection.close()
        host, port = self.address
        try:
            reader, writer = await asyncio.open_connection(
                host, port, ssl=self._tls, server_hostname=self._server_hostname, limit=READ_CHUNK
            )
        except ssl.SSLCertVerificationError:
            raise  # a certificate that failed will fail again: not a connection to retry
        except OSError as e:
            raise CouldNotConnect(f"cannot connect to the API server at {self.host_header}: {e}") from e
        return _Connection(reader, writer)

    def release(self, connection: _Connection, slots: asyncio.Semaphore, reuse: bool) -> None:
        http = connection.http
        if reuse and slots is self._slots and http.our_state is h11.DONE and http.their_state is h11.DONE:
            http.start_next_cycle()
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            connection.close()
        slots.release()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
        for connection in idle:
            with contextlib.suppress(OSError, RuntimeError):
                await connection.writer.wait_closed()
