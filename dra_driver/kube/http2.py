"""HTTP/2 to one API server: many requests at once as streams of one TLS connection, h2 for the protocol.

`dra_driver.kube.transport.Pool` hands a connection here when TLS's ALPN chose "h2" (as
kube-apiserver does) and the server is far (transport says when); this module is imported
only then. `Http2Connection.send` opens one
stream per request (at most the server's MAX_CONCURRENT_STREAMS and MAX_STREAMS at once: a
request past them waits for a stream to end) and returns the `Http2Response` once its head
has arrived; the caller reads the body chunk by chunk and releases the response, which
cancels (RST_STREAM) a stream not read to its end. A far API server is why: sixteen claim
reads at once go out together, one round trip, where HTTP/1.1 holds one request per
connection and a bounded pool makes the rest wait a whole round trip each.

Flow control: every stream's receive window is STREAM_WINDOW, the connection's MAX_STREAMS
times that, so a stream whose reader is slow (a watch) stops only itself; what a stream
holds unread is at most its window, and received data is acknowledged (WINDOW_UPDATE) as
the caller takes it. A request body goes out as the server's windows allow.

Failures, in the terms `dra_driver.kube` retries by: a request whose stream never opened,
or that the server refused unprocessed (a GOAWAY's last stream id below it, RST_STREAM
REFUSED_STREAM), raises `CouldNotConnect` (any method may repeat it); a stream reset
otherwise, or a connection that broke or ended (GOAWAY) before the answer did, raises
ConnectionError (only a GET is repeated). h2 takes no frame after a GOAWAY, so the streams
up to its last stream id end there too, as on a broken connection, rather than finishing.
After a request was given up on before its answer came (the connection may be dead), no
new stream goes on this connection: the pool opens another; the streams under way finish.

Why h2: the HTTP/2 state machine (framing, HPACK, flow-control accounting, stream states)
with no I/O of its own, as h11 is for HTTP/1.1. It must NOT parse frames itself (h2 does),
retry or time out (`dra_driver.kube` decides), push or accept pushed streams, speak h2c
(cleartext HTTP/2), or know what a Kubernetes object is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from http import HTTPStatus
from typing import Final

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from dra_driver.kube.response import IDLE_SECONDS, READ_CHUNK, CouldNotConnect, Response

MAX_STREAMS: Final = 64  # requests at once on one connection, whatever the server allows
STREAM_WINDOW: Final = 256 * 2**10  # what one stream may hold unread
MAX_HEADER_LIST_BYTES: Final = 64 * 2**10  # a response's headers, as transport.MAX_HEAD_BYTES

# What a stream's queue holds: a piece of the body and its flow-controlled length, the end
# of the answer (None), or why it will not come.
_Item = tuple[bytes, int] | BaseException | None


class _Stream:
    def __init__(self, stream_id: int) -> None:
        self.id = stream_id
        self.head: asyncio.Future[tuple[int, list[tuple[bytes, bytes]]]] = (
            asyncio.get_running_loop().create_future()
        )
        self.body: asyncio.Queue[_Item] = asyncio.Queue()
        self.window_open = asyncio.Event()  # the server's window for our body grew
        self.ended = False  # END_STREAM received: the answer is whole in `body`
        self.failed: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        if self.failed is not None or self.ended:
            return
        self.failed = error
        if not self.head.done():
            self.head.set_exception(error)
            self.head.exception()  # retrieved: a caller that gave up does not log it
        self.body.put_nowait(error)
        self.window_open.set()


class Http2Connection:
    """One HTTP/2 connection on open asyncio streams whose TLS chose "h2"; `start` it first."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, authority: str) -> None:
        self._reader = reader
        self._writer = writer
        self._authority = authority.encode()
        # Header checks off, both ways (they are much of h2's CPU per request): ours are
        # lower-case and valid as built, and of the server's only :status and content-length
        # are read (`_on` checks :status; h2 holds the body to content-length either way).
        config = h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
            validate_inbound_headers=False,
            normalize_inbound_headers=False,
        )
        self._h2 = h2.connection.H2Connection(config=config)
        self._streams: dict[int, _Stream] = {}  # open on the wire
        self._changed = asyncio.Event()  # set (and replaced) when a stream ends or the limit changes
        self._retired = False  # no new streams: GOAWAY, or a request given up on
        self._closed = False
        self._idle_since = time.monotonic()
        self._reading: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._h2.initiate_connection()
        self._h2.update_settings({
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_BYTES,
        })
        grow = MAX_STREAMS * STREAM_WINDOW - self._h2.inbound_flow_control_window
        self._h2.increment_flow_control_window(grow)
        self._flush()
        self._reading = asyncio.get_running_loop().create_task(self._read(), name="kube-http2-reader")

    @property
    def closed(self) -> bool:
        return self._closed

    def usable(self) -> bool:
        """New streams may go on it: open, no GOAWAY, and not idle for too long."""
        return (
            not self._closed
            and not self._retired
            and not self._writer.is_closing()
            and (bool(self._streams) or time.monotonic() - self._idle_since < IDLE_SECONDS)
        )

    async def send(
        self, method: str, target: str, headers: Sequence[tuple[str, str]], body: bytes | None
    ) -> Http2Response | None:
        """Open a stream for one request and wait for its answer's head; None when no stream
        can be opened on this connection any more (the request never left: the caller takes
        another connection)."""
        while self.usable() and len(self._streams) >= self._limit():
            await self._changed.wait()
        if not self.usable():
            return None
        stream = _Stream(self._h2.get_next_available_stream_id())
        self._streams[stream.id] = stream
        fields = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", self._authority),
            (b":path", target.encode()),
            *((name.lower().encode(), value.encode()) for name, value in headers),
        ]
        if body is not None:
            fields.append((b"content-length", str(len(body)).encode()))
        try:
            try:
                self._h2.send_headers(stream.id, fields, end_stream=not body)
                self._flush()
                if body:
                    await self._send_body(stream, body)
            except h2.exceptions.ProtocolError as e:
                raise ConnectionError(f"the request could not go out on the HTTP/2 connection: {e}") from e
            head = await stream.head
        except BaseException as e:
            if not isinstance(e, ConnectionError):
                self._retired = True  # given up on (its deadline): the connection may be dead
            self.release(stream)
            raise
        return Http2Response(self, stream, head)

    def _limit(self) -> int:
        return min(MAX_STREAMS, self._h2.remote_settings.max_concurrent_streams)

    async def _send_body(self, stream: _Stream, body: bytes) -> None:
        view = memoryview(body)
        while view and not stream.ended:  # the server may answer before it took the whole body
            if stream.failed is not None:
                raise stream.failed
            window = self._h2.local_flow_control_window(stream.id)
            size = min(len(view), window, self._h2.max_outbound_frame_size)
            if size <= 0:
                stream.window_open.clear()
                await stream.window_open.wait()
                continue
            self._h2.send_data(stream.id, view[:size].tobytes(), end_stream=size == len(view))
            view = view[size:]
            self._flush()
            await self._writer.drain()
        if view and not self._closed:  # answered early: the rest is not wanted (RFC 9113 8.1)
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.reset_stream(stream.id, h2.errors.ErrorCodes.NO_ERROR)
                self._flush()

    def _flush(self) -> None:
        data = self._h2.data_to_send()
        if data and not self._writer.is_closing():
            self._writer.write(data)

    async def _read(self) -> None:
        error: BaseException = ConnectionError(
            "the API server closed the HTTP/2 connection before the answer ended"
        )
        try:
            while data := await self._reader.read(READ_CHUNK):
                for event in self._h2.receive_data(data):
                    self._on(event)
                self._flush()
        except h2.exceptions.ProtocolError as e:
            error = ConnectionError(f"the API server's answer is not valid HTTP/2: {e!r}")
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.close_connection(h2.errors.ErrorCodes.PROTOCOL_ERROR)
                self._flush()
        except OSError as e:
            error = ConnectionError(f"the HTTP/2 connection to the API server broke: {e}")
        except Exception as e:  # whatever it was, no stream may wait for an answer that cannot come
            error = ConnectionError(f"the HTTP/2 connection to the API server failed: {e!r}")
        finally:
            self._closed = True
            for stream in list(self._streams.values()):
                stream.fail(error)
            self._streams.clear()
            self._close_transport()
            self._wake()

    def _on(self, event: h2.events.Event) -> None:
        stream = self._streams.get(getattr(event, "stream_id", 0) or 0)
        if isinstance(event, h2.events.ResponseReceived) and stream is not None:
            head = [(bytes(k), bytes(v)) for k, v in event.headers or []]
            status = next((v for k, v in head if k == b":status"), b"")
            if len(status) != 3 or not status.isdigit():
                stream.fail(ConnectionError(f"the API server's answer has no valid :status ({status!r})"))
                self.release(stream)
            elif not stream.head.done():
                stream.head.set_result((int(status), [(k, v) for k, v in head if not k.startswith(b":")]))
        elif isinstance(event, h2.events.DataReceived):
            if stream is None or stream.failed is not None:
                # Nobody will read it: its room goes back to the connection at once.
                self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            else:
                stream.body.put_nowait((event.data, event.flow_controlled_length))
        elif isinstance(event, h2.events.StreamEnded) and stream is not None:
            stream.ended = True
            stream.body.put_nowait(None)
            self._off_the_wire(stream)
        elif isinstance(event, h2.events.StreamReset) and stream is not None:
            code = event.error_code
            if code == h2.errors.ErrorCodes.REFUSED_STREAM:
                stream.fail(CouldNotConnect(f"the API server refused the request unprocessed ({code!r})"))
            else:
                stream.fail(ConnectionError(f"the API server reset the request's stream ({code!r})"))
            self._off_the_wire(stream)
        elif isinstance(event, h2.events.ConnectionTerminated):
            self._on_goaway(event)
        elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            # A window grew (INITIAL_WINDOW_SIZE changes every stream's), or the stream limit changed.
            for waiting in [stream] if stream is not None else list(self._streams.values()):
                waiting.window_open.set()
            self._wake()

    def _on_goaway(self, event: h2.events.ConnectionTerminated) -> None:
        """Streams past the GOAWAY's last stream id were not processed: CouldNotConnect. Those
        up to it may have been, and would complete (RFC 9113 6.8), but h2 ends its connection
        state at a GOAWAY and takes no frame after it (python-hyper/h2#1181): they fail as
        when a connection breaks mid-answer."""
        self._retired = True
        last = event.last_stream_id or 0
        for stream in list(self._streams.values()):
            if stream.id > last:
                stream.fail(CouldNotConnect(
                    f"the API server ended the connection (GOAWAY {event.error_code!r}) "
                    "before taking the request"
                ))
            else:
                stream.fail(ConnectionError(
                    f"the API server ended the connection (GOAWAY {event.error_code!r}) "
                    "before the answer ended"
                ))
            self._off_the_wire(stream)
        self._close_transport()
        self._wake()

    def _off_the_wire(self, stream: _Stream) -> None:
        if self._streams.pop(stream.id, None) is None:
            return
        if not self._streams:
            self._idle_since = time.monotonic()
            if self._retired:
                self._close_transport()
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _close_transport(self) -> None:
        self._closed = True
        with contextlib.suppress(RuntimeError):  # its event loop has ended
            self._writer.close()

    def take(self, stream: _Stream, flow_controlled: int) -> None:
        """The caller took `flow_controlled` bytes of the stream: the server may send more."""
        if flow_controlled and not self._closed:
            self._h2.acknowledge_received_data(flow_controlled, stream.id)
            self._flush()

    def release(self, stream: _Stream) -> None:
        """The caller is done with the stream: cancelled on the wire if still open there, and
        what it left unread given back to the connection's window."""
        if stream.id in self._streams and not self._closed:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.reset_stream(stream.id, h2.errors.ErrorCodes.CANCEL)
        self._off_the_wire(stream)
        unread = 0
        while not stream.body.empty():
            item = stream.body.get_nowait()
            if isinstance(item, tuple):
                unread += item[1]
        if unread and not self._closed:
            self._h2.acknowledge_received_data(unread, stream.id)
        if not self._closed:
            self._flush()

    async def close(self) -> None:
        if not self._closed:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.close_connection()
                self._flush()
        self._close_transport()
        if self._reading is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reading
        with contextlib.suppress(OSError, RuntimeError):
            await self._writer.wait_closed()


class Http2Response(Response):
    """An answer on one stream whose head has arrived."""

    def __init__(
        self, connection: Http2Connection, stream: _Stream, head: tuple[int, list[tuple[bytes, bytes]]]
    ) -> None:
        status, headers = head
        try:
            reason = HTTPStatus(status).phrase  # HTTP/2 carries no reason phrase
        except ValueError:
            reason = ""
        super().__init__(status, reason, headers)
        self._connection: Http2Connection | None = connection
        self._stream = stream

    async def chunks(self) -> AsyncIterator[bytes]:
        while self._connection is not None:
            item = await self._stream.body.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            data, flow_controlled = item
            self._connection.take(self._stream, flow_controlled)
            if data:
                yield data

    def close(self) -> None:
        """Nothing more to do: a stream not read to its end is cancelled when released."""

    def release(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.release(self._stream)
