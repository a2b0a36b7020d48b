"""HTTP/2 wire format (RFC 9113) for the gRPC server: frame headers, the frames we send,
and the HPACK encoding of our own response headers.

Pure functions on bytes. It must not keep connection state (connection.py does) and
must not decode header blocks (headers.py does, with the dynamic table the peer built).
Our own header blocks never use the dynamic table, so no encoder state exists.
"""

from __future__ import annotations

from enum import IntEnum

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_SIZE = 9
DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = 2**31 - 1
MAX_STREAM = 2**31 - 1


class FrameType(IntEnum):
    DATA = 0
    HEADERS = 1
    PRIORITY = 2
    RST_STREAM = 3
    SETTINGS = 4
    PUSH_PROMISE = 5
    PING = 6
    GOAWAY = 7
    WINDOW_UPDATE = 8
    CONTINUATION = 9


class Flag:
    END_STREAM = 0x1
    ACK = 0x1
    END_HEADERS = 0x4
    PADDED = 0x8
    PRIORITY = 0x20


class Setting(IntEnum):
    HEADER_TABLE_SIZE = 1
    ENABLE_PUSH = 2
    MAX_CONCURRENT_STREAMS = 3
    INITIAL_WINDOW_SIZE = 4
    MAX_FRAME_SIZE = 5
    MAX_HEADER_LIST_SIZE = 6


class ErrorCode(IntEnum):
    NO_ERROR = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2
    FLOW_CONTROL_ERROR = 3
    STREAM_CLOSED = 5
    FRAME_SIZE_ERROR = 6
    REFUSED_STREAM = 7
    CANCEL = 8
    COMPRESSION_ERROR = 9


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def settings(values: dict[Setting, int]) -> bytes:
    payload = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in values.items())
    return frame(FrameType.SETTINGS, 0, 0, payload)


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    """(identifier, value) pairs; the caller checks the length is a multiple of 6."""
    return [
        (int.from_bytes(payload[i : i + 2], "big"), int.from_bytes(payload[i + 2 : i + 6], "big"))
        for i in range(0, len(payload), 6)
    ]


def window_update(stream: int, increment: int) -> bytes:
    return frame(FrameType.WINDOW_UPDATE, 0, stream, increment.to_bytes(4, "big"))


def rst_stream(stream: int, code: ErrorCode) -> bytes:
    return frame(FrameType.RST_STREAM, 0, stream, int(code).to_bytes(4, "big"))


def goaway(last_stream: int, code: ErrorCode, debug: str = "") -> bytes:
    payload = last_stream.to_bytes(4, "big") + int(code).to_bytes(4, "big") + debug.encode()[:1024]
    return frame(FrameType.GOAWAY, 0, 0, payload)


def data_frames(stream: int, data: bytes | bytearray, max_frame: int) -> list[bytes]:
    """`data` (not empty) cut into DATA frames of at most `max_frame` bytes; the stream
    ends with trailers, never with a DATA frame."""
    return [
        frame(FrameType.DATA, 0, stream, bytes(data[start : start + max_frame]))
        for start in range(0, len(data), max_frame)
    ]


def hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """RFC 7541 5.1: `value` with an N-bit prefix; `first` holds the bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_literal(name: bytes | int, value: bytes) -> bytes:
    """A header field as 'literal without indexing' (RFC 7541 6.2.2), no Huffman coding:
    `name` is a static-table index or the name itself."""
    head = hpack_int(name, 4, 0) if isinstance(name, int) else b"\x00" + hpack_int(len(name), 7, 0) + name
    return head + hpack_int(len(value), 7, 0) + value


STATUS_200 = b"\x88"  # static table index 8, ":status: 200"
_CONTENT_TYPE = 31  # static table index of "content-type"
GRPC_RESPONSE_HEADERS = STATUS_200 + hpack_literal(_CONTENT_TYPE, b"application/grpc")


def http_status(code: int) -> bytes:
    return hpack_literal(8, str(code).encode())  # name ":status" (index 8)
