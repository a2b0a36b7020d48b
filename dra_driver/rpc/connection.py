"""One HTTP/2 connection of the gRPC server (RFC 9113, server side, no push).

It turns frames into complete requests (headers decoded, body gathered) for a
`Dispatcher`, sends what the dispatcher answers within the peer's flow-control windows
and frame size, acknowledges SETTINGS and PING, keeps the receive windows open, and
cancels a call's task when the peer resets its stream or the connection ends. A peer
that breaks the protocol gets a GOAWAY that says what it did, and the connection closes.

It must not know gRPC (paths, messages, statuses: server.py) and must not block: it
runs in the event loop's protocol callbacks, one connection at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol

import structlog

from dra_driver.rpc import frames
from dra_driver.rpc.frames import ErrorCode, Flag, FrameType, Setting
from dra_driver.rpc.headers import HeaderDecoder, HeaderError

log = structlog.get_logger(__name__)

Headers = list[tuple[bytes, bytes]]

# What we announce. Requests are small (a Prepare of 100 claims is ~10 KiB), so one
# large window up front means the peer never waits for a WINDOW_UPDATE.
RECEIVE_WINDOW = 1 << 20
MAX_CONCURRENT_STREAMS = 1000
MAX_HEADER_LIST_SIZE = 16_384
OUR_SETTINGS = {
    Setting.ENABLE_PUSH: 0,
    Setting.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
    Setting.INITIAL_WINDOW_SIZE: RECEIVE_WINDOW,
    Setting.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_SIZE,
}


_GOAWAY_PING = b"goaway\x00\x00"


class Dispatcher(Protocol):
    def dispatch(
        self, conn: Connection, stream: int, headers: Headers, body: bytes | None
    ) -> asyncio.Task[None] | None:
        """Start answering a complete request (None: answered at once); `body` None: it
        exceeded the connection's `body_limit`."""
        ...


class ProtocolError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Stream:
    __slots__ = (
        "body",
        "done",
        "drained",
        "headers",
        "pending",
        "recv_unacked",
        "send_window",
        "task",
        "trailers",
    )

    def __init__(self, headers: Headers, send_window: int) -> None:
        self.headers = headers
        self.body: bytearray | None = bytearray()  # None once over the limit
        self.recv_unacked = 0
        self.send_window = send_window
        self.pending = bytearray()  # DATA waiting for window
        self.trailers: bytes | None = None  # sent once `pending` is empty
        self.task: asyncio.Task[None] | None = None
        self.drained: asyncio.Event | None = None
        self.done = False  # remote side ended (END_STREAM received)


class Connection(asyncio.Protocol):
    def __init__(
        self, dispatcher: Dispatcher, body_limit: int, on_close: Callable[[Connection], None]
    ) -> None:
        self._dispatcher = dispatcher
        self._body_limit = body_limit
        self._on_close = on_close
        self._transport: asyncio.Transport | None = None
        self._buffer = b""
        self._preface_seen = False
        self._decoder = HeaderDecoder(max_list_size=MAX_HEADER_LIST_SIZE)
        self._streams: dict[int, _Stream] = {}
        self._last_stream = 0
        self._continuation: tuple[int, int, bytearray] | None = None  # (stream, flags, block so far)
        self._peer_initial_window = frames.DEFAULT_WINDOW
        self._peer_max_frame = frames.DEFAULT_MAX_FRAME
        self._send_window = frames.DEFAULT_WINDOW
        self._recv_unacked = 0
        self._blocked: set[int] = set()  # streams with data waiting for the connection window
        self._out: list[bytes] | None = None  # frames batched while handling one read
        self._going_away = False
        self._ping_answered: asyncio.Future[None] | None = None  # while going away
        self.closed = asyncio.get_running_loop().create_future()

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.write(
            frames.settings(OUR_SETTINGS) + frames.window_update(0, RECEIVE_WINDOW - frames.DEFAULT_WINDOW)
        )

    def data_received(self, data: bytes) -> None:
        self._out = []
        broken = False
        try:
            self._receive(data)
        except (ProtocolError, HeaderError) as e:
            # Undecodable headers: the shared HPACK table can no longer be trusted either.
            code = e.code if isinstance(e, ProtocolError) else ErrorCode.COMPRESSION_ERROR
            log.warning("closing a kubelet connection that broke HTTP/2", error=str(e), code=code.name)
            self._out.append(frames.goaway(self._last_stream, code, str(e)))
            broken = True
        finally:
            self._send_batch()
            if broken and self._transport is not None:
                self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        for stream in self._streams.values():
            if stream.task is not None:
                stream.task.cancel()
            if stream.drained is not None:
                stream.drained.set()
        self._streams.clear()
        if not self.closed.done():
            self.closed.set_result(None)
        if self._ping_answered is not None and not self._ping_answered.done():
            self._ping_answered.set_result(None)
        self._on_close(self)

    # -- what the dispatcher calls -----------------------------------------------------

    def respond(self, stream: int, headers: bytes, data: bytes, trailers: bytes) -> None:
        """A whole answer (headers, data, trailers) in one write when the windows allow."""
        batched = self._out is None
        if batched:
            self._out = []
        try:
            self.send_headers(stream, headers)
            self.send_data(stream, data)
            self.send_trailers(stream, trailers)
        finally:
            if batched:
                self._send_batch()

    def send_headers(self, stream: int, block: bytes, end_stream: bool = False) -> None:
        if stream not in self._streams:
            return  # reset by the peer meanwhile
        flags = Flag.END_HEADERS | (Flag.END_STREAM if end_stream else 0)
        self._write(frames.frame(FrameType.HEADERS, flags, stream, block))
        if end_stream:
            self._finish(stream)

    def send_data(self, stream: int, data: bytes) -> None:
        state = self._streams.get(stream)
        if state is None:
            return  # reset by the peer meanwhile
        state.pending += data
        self._flush(stream, state)

    def send_trailers(self, stream: int, block: bytes) -> None:
        """End the stream with this header block, after any data still waiting for window."""
        state = self._streams.get(stream)
        if state is None:
            return
        if state.pending:
            state.trailers = block
        else:
            self.send_headers(stream, block, end_stream=True)

    async def drained(self, stream: int) -> None:
        """Return once the stream's data went out (or the stream is gone)."""
        state = self._streams.get(stream)
        if state is None or not state.pending:
            return
        if state.drained is None:
            state.drained = asyncio.Event()
        state.drained.clear()
        await state.drained.wait()

    async def go_away(self, timeout: float) -> None:
        """Accept no new streams, in two steps (RFC 9113 6.8): a GOAWAY that still allows
        every stream and a PING; once the PING is answered, every stream the peer opened
        before it has arrived, and the final GOAWAY names the last one. A single GOAWAY
        would race with requests already on their way, which the peer then sees fail."""
        if self._going_away or self._transport is None:
            return
        self._write(frames.goaway(frames.MAX_STREAM, ErrorCode.NO_ERROR, "server stopping"))
        self._write(frames.frame(FrameType.PING, 0, 0, _GOAWAY_PING))
        self._ping_answered = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._ping_answered), timeout)
        self._going_away = True
        self._write(frames.goaway(self._last_stream, ErrorCode.NO_ERROR, "server stopping"))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # -- receiving ---------------------------------------------------------------------

    def _receive(self, data: bytes) -> None:
        buf = self._buffer + data if self._buffer else data
        if not self._preface_seen:
            if len(buf) < len(frames.PREFACE):
                if not frames.PREFACE.startswith(buf):
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "not an HTTP/2 client preface")
                self._buffer = buf
                return
            if not buf.startswith(frames.PREFACE):
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "not an HTTP/2 client preface")
            buf = buf[len(frames.PREFACE) :]
            self._preface_seen = True
        pos, end = 0, len(buf)
        while end - pos >= frames.FRAME_HEADER_SIZE:
            length = int.from_bytes(buf[pos : pos + 3], "big")
            if length > frames.DEFAULT_MAX_FRAME:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, f"frame of {length} bytes over our 16384")
            if end - pos - frames.FRAME_HEADER_SIZE < length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            stream = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFF_FFFF
            start = pos + frames.FRAME_HEADER_SIZE
            pos = start + length
            self._frame(kind, flags, stream, buf[start:pos])
        self._buffer = buf[pos:]

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if self._continuation is not None and kind != FrameType.CONTINUATION:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a header block was interrupted by another frame")
        if kind == FrameType.DATA:
            self._data(flags, stream, payload)
        elif kind == FrameType.HEADERS:
            self._headers(flags, stream, payload)
        elif kind == FrameType.CONTINUATION:
            if self._continuation is None or self._continuation[0] != stream:
                raise ProtocolError(
                    ErrorCode.PROTOCOL_ERROR, "CONTINUATION without a header block to continue"
                )
            block = self._continuation[2]
            block += payload
            if len(block) > MAX_HEADER_LIST_SIZE * 2:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "header block over our header list size")
            if flags & Flag.END_HEADERS:
                first_flags = self._continuation[1]
                self._continuation = None
                self._header_block(first_flags, stream, bytes(block))
        elif kind == FrameType.SETTINGS:
            self._settings(flags, stream, payload)
        elif kind == FrameType.PING:
            if stream != 0 or len(payload) != 8:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "PING must be 8 bytes on stream 0")
            if not flags & Flag.ACK:
                self._write(frames.frame(FrameType.PING, Flag.ACK, 0, payload))
            elif payload == _GOAWAY_PING and self._ping_answered and not self._ping_answered.done():
                self._ping_answered.set_result(None)
        elif kind == FrameType.WINDOW_UPDATE:
            self._window_update(stream, payload)
        elif kind == FrameType.RST_STREAM:
            if stream == 0 or len(payload) != 4:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM must be 4 bytes on a stream")
            self._reset(stream)
        elif kind == FrameType.GOAWAY:
            self._going_away = True
        elif kind == FrameType.PUSH_PROMISE:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a client must not send PUSH_PROMISE")
        # PRIORITY and unknown frame types are ignored (RFC 9113 5.5).

    def _headers(self, flags: int, stream: int, payload: bytes) -> None:
        if stream == 0:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        payload = _unpad(flags, payload)
        if flags & Flag.PRIORITY:
            payload = payload[5:]
        if flags & Flag.END_HEADERS:
            self._header_block(flags, stream, payload)
        else:
            self._continuation = (stream, flags, bytearray(payload))

    def _header_block(self, flags: int, stream: int, block: bytes) -> None:
        # Decoded even for a stream we refuse: the block may change the shared dynamic table.
        headers = self._decoder.decode(block)
        state = self._streams.get(stream)
        if state is not None:  # trailers from the client end its side; nothing in them is used
            if flags & Flag.END_STREAM:
                self._remote_end(stream, state)
            return
        if stream % 2 == 0 or stream <= self._last_stream:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"stream {stream} is not a new client stream")
        self._last_stream = stream
        if self._going_away or len(self._streams) >= MAX_CONCURRENT_STREAMS:
            self._write(frames.rst_stream(stream, ErrorCode.REFUSED_STREAM))
            return
        state = _Stream(headers, self._peer_initial_window)
        self._streams[stream] = state
        if flags & Flag.END_STREAM:
            self._remote_end(stream, state)

    def _data(self, flags: int, stream: int, payload: bytes) -> None:
        if stream == 0:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        self._recv_unacked += len(payload)
        if self._recv_unacked >= RECEIVE_WINDOW // 2:
            self._write(frames.window_update(0, self._recv_unacked))
            self._recv_unacked = 0
        state = self._streams.get(stream)
        if state is None or state.done:
            if stream > self._last_stream:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"DATA on idle stream {stream}")
            self._write(frames.rst_stream(stream, ErrorCode.STREAM_CLOSED))
            return
        if state.body is not None:
            state.body += _unpad(flags, payload)
            if len(state.body) > self._body_limit:
                state.body = None
        if flags & Flag.END_STREAM:
            self._remote_end(stream, state)
            return
        state.recv_unacked += len(payload)
        if state.recv_unacked >= RECEIVE_WINDOW // 2:
            self._write(frames.window_update(stream, state.recv_unacked))
            state.recv_unacked = 0

    def _remote_end(self, stream: int, state: _Stream) -> None:
        if state.done:
            return
        state.done = True
        body = bytes(state.body) if state.body is not None else None
        state.task = self._dispatcher.dispatch(self, stream, state.headers, body)

    def _settings(self, flags: int, stream: int, payload: bytes) -> None:
        if stream != 0:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & Flag.ACK:
            return
        if len(payload) % 6:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS length is not a multiple of 6")
        for key, value in frames.parse_settings(payload):
            if key == Setting.INITIAL_WINDOW_SIZE:
                if value > frames.MAX_WINDOW:
                    raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for state in self._streams.values():
                    state.send_window += delta
            elif key == Setting.MAX_FRAME_SIZE:
                if not frames.DEFAULT_MAX_FRAME <= value <= 16_777_215:
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"max frame size {value} out of range")
                self._peer_max_frame = value
        self._write(frames.frame(FrameType.SETTINGS, Flag.ACK, 0))
        self._flush_all()

    def _window_update(self, stream: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE must be 4 bytes")
        increment = int.from_bytes(payload, "big") & 0x7FFF_FFFF
        if increment == 0:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        if stream == 0:
            self._send_window += increment
            if self._send_window > frames.MAX_WINDOW:
                raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "connection window over 2^31-1")
            self._flush_all()
            return
        state = self._streams.get(stream)
        if state is not None:
            state.send_window += increment
            self._flush(stream, state)

    def _reset(self, stream: int) -> None:
        state = self._streams.pop(stream, None)
        self._blocked.discard(stream)
        if state is None:
            return
        if state.task is not None:
            state.task.cancel()
        if state.drained is not None:
            state.drained.set()

    # -- sending -----------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        if self._out is not None:
            self._out.append(data)
        elif self._transport is not None:
            self._transport.write(data)

    def _send_batch(self) -> None:
        """Write the frames gathered in `_out` as one write, and stop gathering."""
        out, self._out = self._out, None
        if out and self._transport is not None:
            self._transport.write(b"".join(out))

    def _flush(self, stream: int, state: _Stream) -> None:
        size = min(len(state.pending), state.send_window, self._send_window)
        if size > 0:
            chunk = state.pending[:size]
            del state.pending[:size]
            state.send_window -= size
            self._send_window -= size
            for f in frames.data_frames(stream, chunk, self._peer_max_frame):
                self._write(f)
        if state.pending:
            self._blocked.add(stream)
            return
        self._blocked.discard(stream)
        if state.drained is not None:
            state.drained.set()
        if state.trailers is not None:
            block, state.trailers = state.trailers, None
            self.send_headers(stream, block, end_stream=True)

    def _flush_all(self) -> None:
        for stream in list(self._blocked):
            state = self._streams.get(stream)
            if state is None:
                self._blocked.discard(stream)
            elif self._send_window > 0:
                self._flush(stream, state)

    def _finish(self, stream: int) -> None:
        """We sent END_STREAM: if the peer has not ended its side, tell it to stop sending."""
        state = self._streams.pop(stream, None)
        self._blocked.discard(stream)
        if state is not None and not state.done:
            self._write(frames.rst_stream(stream, ErrorCode.NO_ERROR))


def _unpad(flags: int, payload: bytes) -> bytes:
    if not flags & Flag.PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - payload[0]]
