"""The API client's HTTP/1.1 layer against a scripted server: framing, keep-alive, stale connections."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from dra_driver.http1 import ConnectionPool, ProtocolError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


async def _with_server(handler: Handler, test: Callable[[ConnectionPool], Awaitable[None]]) -> None:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = ConnectionPool("127.0.0.1", port, None)
    try:
        await test(pool)
    finally:
        await pool.close()
        server.close()


def test_keep_alive_reuses_one_connection_for_length_and_chunked_bodies() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while not reader.at_eof():
            try:
                request = await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            if request.startswith(b"POST"):
                body = request.split(b"\r\n\r\n", 1)[1]
                writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            else:
                chunks = b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"  # with a chunk extension
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks)
            await writer.drain()
        writer.close()

    async def test(pool: ConnectionPool) -> None:
        for _ in range(3):
            got = await pool.request("GET", "/a", {})
            assert (got.status, got.body) == (200, b"abcde")
            posted = await pool.request("POST", "/b", {"Content-Type": "application/json"}, b'{"x": 1}')
            assert (posted.status, posted.reason, posted.body) == (201, "Created", b'{"x": 1}')
        assert connections == 1

    asyncio.run(_with_server(handler, test))


def test_a_connection_the_server_closed_while_idle_is_replaced_for_a_get() -> None:
    answered = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        await _read_request(reader)
        answered += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # keep-alive announced but not kept: as an API server at its idle timeout

    async def test(pool: ConnectionPool) -> None:
        for _ in range(3):
            assert (await pool.request("GET", "/", {})).body == b"ok"
        assert answered == 3

    asyncio.run(_with_server(handler, test))


def test_watch_lines_stream_and_a_broken_body_is_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await _read_request(reader)
        if b"/broken" in request:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for part in (b'{"a":', b'1}\n{"b":2}\n', b'\n{"c":3}'):
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def test(pool: ConnectionPool) -> None:
        async with pool.stream("GET", "/watch", {}) as (status, _, _, body):
            assert status == 200
            assert [line async for line in body.lines()] == [b'{"a":1}', b'{"b":2}', b"", b'{"c":3}']
        with pytest.raises(ConnectionError, match="7 bytes of the body unread"):
            await pool.request("GET", "/broken", {})

    asyncio.run(_with_server(handler, test))


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", r"not an HTTP/1\.1 status line"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "not a chunk size line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "not a Content-Length"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "not an HTTP header line"),
        (b"HTTP/1.1 200 OK\r\n" + b"X-Long: " + b"x" * 70000 + b"\r\n\r\n", "response headers longer than"),
    ],
)
def test_an_answer_that_is_not_http_is_a_protocol_error(answer: bytes, message: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def test(pool: ConnectionPool) -> None:
        with pytest.raises(ProtocolError, match=message):
            await pool.request("GET", "/", {})

    asyncio.run(_with_server(handler, test))


def test_an_answer_cut_off_in_its_headers_is_a_connection_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Le")
        await writer.drain()
        writer.close()

    async def test(pool: ConnectionPool) -> None:
        with pytest.raises(ConnectionError, match="in the middle of the response headers"):
            await pool.request("GET", "/", {})

    asyncio.run(_with_server(handler, test))
