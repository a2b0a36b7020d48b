"""HPACK decoding of the gRPC server (dra_driver/rpc/headers.py) against hpack's encoder."""

from __future__ import annotations

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dra_driver.rpc.headers import HeaderDecoder, HeaderError

_names = st.sampled_from(
    [b"content-type", b":path", b"grpc-timeout", b"user-agent", b"x-a", b"x-b"]
) | st.binary(min_size=1, max_size=40).map(lambda b: b"x-" + b.hex().encode())
_values = st.binary(max_size=300)
_block = st.lists(st.tuples(_names, _values, st.booleans()), max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    blocks=st.lists(_block, min_size=1, max_size=12),
    huffman=st.booleans(),
    table_sizes=st.lists(st.sampled_from([None, 0, 64, 256, 4096]), min_size=12, max_size=12),
)
def test_decodes_what_hpack_encodes_through_table_growth_eviction_and_resizes(
    blocks: list[list[tuple[bytes, bytes, bool]]], huffman: bool, table_sizes: list[int | None]
) -> None:
    encoder = hpack.Encoder()
    ours = HeaderDecoder(max_list_size=1 << 20)
    for headers, size in zip(blocks, table_sizes, strict=False):
        if size is not None:
            encoder.header_table_size = size  # the next block starts with a size update
        fields = [hpack.NeverIndexedHeaderTuple(n, v) if secret else (n, v) for n, v, secret in headers]
        block = encoder.encode(fields, huffman=huffman)
        assert ours.decode(block) == [(n, v) for n, v, _ in headers]


@pytest.mark.parametrize(
    ("block", "says"),
    [
        (b"\x80", "index 0"),
        (b"\xff\x00", "index 127 out of range"),  # 62 + 65: past an empty dynamic table
        (b"\xbe", "index 62 out of range"),
        (b"\xff", "ends inside an integer"),
        (b"\xff\xff\xff\xff\xff\xff\x01", "too large"),
        (b"\x40\x05ab", "runs past the end"),
        (b"\x40", "ends before a string"),
        (b"\x3f\xe2\x1f", "update to 4097 over the announced 4096"),
        (b"\x00\x01a\x81\xff", "bad Huffman"),
    ],
)
def test_a_malformed_block_is_refused_with_what_is_wrong(block: bytes, says: str) -> None:
    with pytest.raises(HeaderError, match=says):
        HeaderDecoder().decode(block)


def test_a_header_list_over_the_limit_is_refused() -> None:
    block = hpack.Encoder().encode([(b"x-big", b"v" * 2000)] * 9)
    with pytest.raises(HeaderError, match="larger than 16384"):
        HeaderDecoder(max_list_size=16_384).decode(block)


def test_an_entry_larger_than_the_table_empties_it() -> None:
    decoder = HeaderDecoder(max_table_size=100)
    decoder.decode(b"\x40\x03x-a\x01v")  # 3 + 1 + 32 = 36 bytes: kept
    assert decoder.decode(b"\xbe") == [(b"x-a", b"v")]
    decoder.decode(b"\x40\x03x-b" + b"\x7f\x21" + b"w" * 160)  # larger than 100: the table empties
    with pytest.raises(HeaderError, match="index 62 out of range"):
        decoder.decode(b"\xbe")
