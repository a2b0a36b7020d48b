"""Connections to one API server over asyncio streams: HTTP/2 when TLS offers it, else HTTP/1.1.

`Pool.send` writes one request and returns the `Response` as soon as its head has arrived;
the caller reads the body chunk by chunk (`Response.chunks`) and leaves `async with
response`, which releases what the answer held.

Which protocol: a TLS connection offers "h2" and "http/1.1" in ALPN. When the server chooses
"h2" (kube-apiserver does) and is far (its first connection, TCP and TLS, took
FAR_HANDSHAKE_SECONDS or more), every request is a stream of one shared connection
(`dra_driver.kube.http2`, imported only then): a burst of claim reads goes out at once, one
round trip, where HTTP/1.1 connections made the requests past them wait a round trip each. A
near server gets HTTP/1.1 (that first connection is closed, and later ones offer only
"http/1.1"): a round trip there costs less than h2's pure-Python framing and HPACK add to
every request's CPU. `http2=True` takes HTTP/2 wherever it is offered, False never. Plain
HTTP, or a server without HTTP/2, is HTTP/1.1 too: keep-alive connections, at most `size`
open at once (a request past them waits for a free one); a connection is put back when the
answer was read to its end and both sides may go on, and closed otherwise. Until the first
TLS handshake has said which, one connection is opened and the requests of a burst wait for
it rather than each opening one.

Why h11 (and h2) and not aiohttp: each is a protocol state machine (framing, bodies,
keep-alive or stream rules) with no I/O of its own, next to nothing in memory once
imported; aiohttp's client cost every node resident memory and start CPU (docs/install.md,
"What the plugin costs a node") for one peer that speaks JSON. Not http.client: it blocks,
and the daemon is asyncio throughout.

It must NOT parse HTTP itself (h11 and h2 do), retry or time out (`dra_driver.kube` decides,
inside the caller's deadline), follow redirects, read proxy variables, or know what a
Kubernetes object is.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Final

import h11

from dra_driver.kube.response import IDLE_SECONDS, READ_CHUNK, CouldNotConnect, Response

if TYPE_CHECKING:
    from dra_driver.kube.http2 import Http2Connection

MAX_HEAD_BYTES: Final = 64 * 2**10  # a response's status line and headers
ALPN: Final = ("h2", "http/1.1")
# A first connection (TCP and TLS) that took less than this is a near API server: HTTP/1.1.
FAR_HANDSHAKE_SECONDS: Final = 0.01


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


class _Http11Response(Response):
    def __init__(
        self, pool: Pool, slots: asyncio.Semaphore, connection: _Connection, head: h11.Response
    ) -> None:
        super().__init__(head.status_code, head.reason.decode("latin-1"), head.headers)
        self._pool = pool
        self._slots = slots
        self._connection: _Connection | None = connection
        self._ended = False
        self._keep = True

    async def chunks(self) -> AsyncIterator[bytes]:
        while not self._ended and self._connection is not None:
            event = await self._connection.next_event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._ended = True

    def close(self) -> None:
        """The connection goes with the unread rest when the response is released."""
        self._keep = False

    def release(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._pool.release(connection, self._slots, reuse=self._ended and self._keep)


class Pool:
    """Requests to `host:port`, over TLS when `tls` is a context (it is given ALPN's choices):
    HTTP/2 streams of one connection when the server chooses "h2", else at most `size`
    HTTP/1.1 connections."""

    def __init__(
        self,
        host: str,
        port: int,
        tls: ssl.SSLContext | None,
        server_hostname: str | None,
        size: int,
        http2: bool | None = None,
    ) -> None:
        self.host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.address = (host, port)
        self._tls = tls
        self._http2 = http2  # None: when the server is far; True: whenever offered; False: never
        if tls is not None:
            tls.set_alpn_protocols(list(ALPN) if http2 is not False else ["http/1.1"])
        self._server_hostname = (server_hostname or host) if tls is not None else None
        self._size = size
        self._idle: list[_Connection] = []
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._protocol = ""  # in use: "h2", "http/1.1", or "" (no TLS connection made yet)
        self._shared_connection: Http2Connection | None = None
        self._opening: asyncio.Task[Http2Connection | None] | None = None
        self._retired: set[Http2Connection] = set()  # replaced, still finishing their streams

    def _for_this_loop(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._loop is not loop:
            # Connections and waiters belong to the loop that made them (a CLI may run several).
            for connection in self._idle:
                connection.close()
            self._idle, self._slots, self._loop = [], asyncio.Semaphore(self._size), loop
            self._shared_connection, self._opening, self._retired = None, None, set()
        return self._slots

    @property
    def protocol(self) -> str:
        """The protocol in use over TLS ("h2" or "http/1.1"); "" before the first connection."""
        return self._protocol

    async def send(
        self, method: str, target: str, headers: Sequence[tuple[str, str]], body: bytes | None
    ) -> Response:
        """Write one request and wait for its answer's head; the caller releases the response."""
        slots = self._for_this_loop()
        while self._tls is not None and self._protocol != "http/1.1":
            connection = await self._shared()
            if connection is None:
                break  # HTTP/1.1: the server chose it, or is near
            response = await connection.send(method, target, headers, body)
            if response is not None:
                return response
            # That connection takes no more streams: the request never left; take another.
        return await self._send_http11(slots, method, target, headers, body)

    async def _shared(self) -> Http2Connection | None:
        """The HTTP/2 connection, opened once for all who wait for it; None when the server
        chose HTTP/1.1 (its connection is then idle in the pool) or is near (see `_adopt`)."""
        shared = self._shared_connection
        if shared is not None and shared.usable():
            return shared
        if shared is not None:
            self._retired = {c for c in self._retired if not c.closed}
            self._retired.add(shared)  # closes itself once its streams have ended
            self._shared_connection = None
        if self._opening is None:
            self._opening = asyncio.get_running_loop().create_task(self._open_shared())
            self._opening.add_done_callback(self._opened)
        # Shielded: one waiter giving up (its deadline) must not cancel the others' connection.
        return await asyncio.shield(self._opening)

    def _opened(self, task: asyncio.Task[Http2Connection | None]) -> None:
        if self._opening is task:
            self._opening = None
        if not task.cancelled():
            task.exception()  # retrieved here too: every waiter may have given up

    async def _open_shared(self) -> Http2Connection | None:
        reader, writer, took = await self._open()
        connection = self._adopt(reader, writer, took)
        if connection is None and not writer.is_closing():
            self._idle.append(_Connection(reader, writer))
        return connection

    def _adopt(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, took: float
    ) -> Http2Connection | None:
        """The shared HTTP/2 connection, made of a new TLS connection whose server chose "h2";
        else None: HTTP/1.1 was chosen (the connection is one), or the server is near, which
        closes the connection and offers only HTTP/1.1 from then on."""
        ssl_object = writer.get_extra_info("ssl_object")
        chosen = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        if chosen == "h2" and self._http2 is None and self._protocol == "" and took < FAR_HANDSHAKE_SECONDS:
            # Near, a round trip is cheap and h2's Python costs more CPU per request than h11.
            writer.close()
            if self._tls is not None:
                self._tls.set_alpn_protocols(["http/1.1"])
            chosen = None
        self._protocol = "h2" if chosen == "h2" else "http/1.1"
        if chosen != "h2":
            return None
        from dra_driver.kube.http2 import Http2Connection  # only for a server that speaks it

        connection = Http2Connection(reader, writer, self.host_header)
        connection.start()
        self._shared_connection = connection
        return connection

    async def _send_http11(
        self,
        slots: asyncio.Semaphore,
        method: str,
        target: str,
        headers: Sequence[tuple[str, str]],
        body: bytes | None,
    ) -> Response:
        await slots.acquire()
        try:
            connection = await self._connection()
        except BaseException:
            slots.release()
            raise
        if connection is None:  # the server chose HTTP/2 this time
            slots.release()
            return await self.send(method, target, headers, body)
        try:
            fields = [("Host", self.host_header), *headers]
            if body is not None:
                fields.append(("Content-Length", str(len(body))))
            events = [h11.Request(method=method, target=target, headers=fields),
                      *([h11.Data(data=body)] if body else []), h11.EndOfMessage()]
            connection.writer.write(b"".join(connection.http.send(e) or b"" for e in events))
            await connection.writer.drain()
            while not isinstance(head := await connection.next_event(), h11.Response):
                pass  # a 1xx (InformationalResponse) comes before the answer
            return _Http11Response(self, slots, connection, head)
        except BaseException:
            connection.close()
            slots.release()
            raise

    async def _connection(self) -> _Connection | None:
        """An idle or new HTTP/1.1 connection; None when a new one's server chose "h2" (it
        became the shared HTTP/2 connection)."""
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable():
                return connection
            connection.close()
        while True:
            reader, writer, took = await self._open()
            if self._tls is None:
                return _Connection(reader, writer)
            if self._adopt(reader, writer, took) is not None:
                return None
            if not writer.is_closing():
                return _Connection(reader, writer)
            # near: closed for a connection that offers only HTTP/1.1

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, float]:
        """A new connection, and the seconds it took to open (TCP and TLS)."""
        host, port = self.address
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            reader, writer = await asyncio.open_connection(
                host, port, ssl=self._tls, server_hostname=self._server_hostname, limit=READ_CHUNK
            )
            return reader, writer, loop.time() - started
        except ssl.SSLCertVerificationError:
            raise  # a certificate that failed will fail again: not a connection to retry
        except OSError as e:
            raise CouldNotConnect(f"cannot connect to the API server at {self.host_header}: {e}") from e

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
        shared = [c for c in (self._shared_connection, *self._retired) if c is not None]
        self._shared_connection, self._retired = None, set()
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
        self._opening = None
        for http2 in shared:
            with contextlib.suppress(RuntimeError):  # its event loop has ended
                await http2.close()
