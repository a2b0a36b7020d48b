"""HPACK (RFC 7541) decoding of the header blocks a client sends the gRPC server.

One decoder per connection: it holds the dynamic table that the peer's encoder builds.
Fast on the common case, a block of one-byte table references and one new literal (the
call's grpc-timeout): hpack's general Decoder spent ~17 us per call there, this ~5 us.
The static table and Huffman code are the hpack package's (the RFC's data, checked
there); everything else is here.

Pure computation on bytes; a malformed block raises `HeaderError` (the connection answers
with COMPRESSION_ERROR: after a bad block the shared table can no longer be trusted).
"""

from __future__ import annotations

from collections import deque

from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

Header = tuple[bytes, bytes]

_STATIC: tuple[Header, ...] = tuple(HeaderTable.STATIC_TABLE)
_ENTRY_OVERHEAD = 32  # RFC 7541 4.1
_MAX_INT = 1 << 32


class HeaderError(Exception):
    pass


class HeaderDecoder:
    def __init__(self, max_table_size: int = 4096, max_list_size: int = 16_384) -> None:
        self._limit = max_table_size  # what we announced (SETTINGS_HEADER_TABLE_SIZE)
        self._max = max_table_size  # what the encoder chose, at most the limit
        self._max_list = max_list_size
        self._table: deque[Header] = deque()  # newest first
        self._size = 0

    def decode(self, block: bytes) -> list[Header]:
        out: list[Header] = []
        listed = 0
        i, end = 0, len(block)
        while i < end:
            first = block[i]
            if first & 0x80:  # indexed field
                index, i = _integer(block, i, 0x7F)
                header = self._entry(index)
            elif first & 0x40:  # literal, added to the table
                index, i = _integer(block, i, 0x3F)
                header, i = self._literal(block, i, index)
                self._add(header)
            elif first & 0x20:  # dynamic table size update
                size, i = _integer(block, i, 0x1F)
                if size > self._limit:
                    raise HeaderError(f"table size update to {size} over the announced {self._limit}")
                self._max = size
                self._evict(0)
                continue
            else:  # literal, not added (0000) or never indexed (0001)
                index, i = _integer(block, i, 0x0F)
                header, i = self._literal(block, i, index)
            listed += len(header[0]) + len(header[1]) + _ENTRY_OVERHEAD
            if listed > self._max_list:
                raise HeaderError(f"header list larger than {self._max_list} bytes")
            out.append(header)
        return out

    def _literal(self, block: bytes, i: int, index: int) -> tuple[Header, int]:
        if index:
            name = self._entry(index)[0]
        else:
            name, i = _string(block, i)
        value, i = _string(block, i)
        return (name, value), i

    def _entry(self, index: int) -> Header:
        if 0 < index <= len(_STATIC):
            return _STATIC[index - 1]
        dynamic = index - len(_STATIC) - 1
        if index == 0 or dynamic >= len(self._table):
            raise HeaderError(f"header table index {index} out of range")
        return self._table[dynamic]

    def _add(self, header: Header) -> None:
        size = len(header[0]) + len(header[1]) + _ENTRY_OVERHEAD
        if size > self._max:  # RFC 7541 4.4: the table empties, the entry is not added
            self._table.clear()
            self._size = 0
            return
        self._evict(size)
        self._table.appendleft(header)
        self._size += size

    def _evict(self, room: int) -> None:
        while self._table and self._size + room > self._max:
            name, value = self._table.pop()
            self._size -= len(name) + len(value) + _ENTRY_OVERHEAD


def _integer(block: bytes, i: int, mask: int) -> tuple[int, int]:
    """RFC 7541 5.1: the integer whose prefix is `mask`'s bits of block[i]; (value, next i)."""
    value = block[i] & mask
    i += 1
    if value < mask:
        return value, i
    shift = 0
    while True:
        if i >= len(block):
            raise HeaderError("header block ends inside an integer")
        byte = block[i]
        i += 1
        value += (byte & 0x7F) << shift
        if value > _MAX_INT:
            raise HeaderError("integer in header block too large")
        if not byte & 0x80:
            return value, i
        shift += 7


def _string(block: bytes, i: int) -> tuple[bytes, int]:
    if i >= len(block):
        raise HeaderError("header block ends before a string")
    huffman = block[i] & 0x80
    length, i = _integer(block, i, 0x7F)
    end = i + length
    if end > len(block):
        raise HeaderError("string runs past the end of the header block")
    raw = block[i:end]
    if huffman:
        try:
            raw = decode_huffman(raw)
        except Exception as e:  # hpack raises its own error type for bad padding or EOS
            raise HeaderError(f"bad Huffman string: {e}") from None
    return raw, end
