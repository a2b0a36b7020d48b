"""dra_driver.kube.transport: the API client's HTTP/1.1 connections, against a plain-HTTP
server in the same event loop that writes exactly the bytes each test scripts.

What is checked here is what h11 leaves to us: when a connection is used again, that a
slot is never lost, and that an answer which is not HTTP is a connection error (TLS, the
retry rules and the bounds are tests/unit/test_kube_client.py and test_kube_bounds.py).
This module must not talk to a real API server.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable

import pytest

from dra_driver import kube
from dra_driver.kube.credentials import Credentials, static
from tests.harness.objects import wait_for_async

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 8\r\n\r\n{\"n\": 1}"
Head = Callable[[], Awaitable[bytes]]  # reads the next request on the connection
Script = Callable[[Head, asyncio.StreamWriter], Awaitable[None]]


async def _request_head(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    if length:
        await reader.readexactly(length)
    return head


async def _serving(scripts: list[Script], run: Callable[[kube.ApiClient], Awaitable[None]],
                   connections: int = 4) -> list[int]:
    """Serve one script per connection, in order; run `run` with a client; return how many
    requests each connection carried."""
    carried: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        carried.append(0)
        index = len(carried) - 1
        script = scripts[index] if index < len(scripts) else _closing_at_once

        async def head() -> bytes:
            request = await _request_head(reader)
            carried[index] += 1
            return request

        try:
            await script(head, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    api = kube.ApiClient(Credentials(f"http://127.0.0.1:{port}", False, static(None)), connections)
    try:
        await run(api)
    finally:
        await api.close()
        server.close()
        await server.wait_closed()
    return carried


async def _closing_at_once(head: Head, writer: asyncio.StreamWriter) -> None:
    await head()


def test_a_connection_the_server_closed_while_idle_is_not_used_for_the_next_request() -> None:
    """A POST is not repeated once sent: it must go out on a connection that is still open,
    not on the one the server closed after its last answer (as an API server's idle timeout does)."""
    closed = asyncio.Event()

    async def answer_once_then_close(head: Head, writer: asyncio.StreamWriter) -> None:
        await head()
        writer.write(OK)
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        closed.set()

    async def answer_twice(head: Head, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await head()
            writer.write(OK)
            await writer.drain()

    async def run(api: kube.ApiClient) -> None:
        assert await kube.request(api, "GET", "/api/v1/nodes/a", timeout=5) == {"n": 1}
        await closed.wait()
        await wait_for_async("the client's end to read the FIN",
                             lambda: all(c.reader.at_eof() for c in api._pool._idle))
        assert await kube.request(api, "POST", "/api/v1/namespaces/n/events", body={}, timeout=5) == {"n": 1}
        assert await kube.request(api, "GET", "/api/v1/nodes/a", timeout=5) == {"n": 1}

    carried = asyncio.run(_serving([answer_once_then_close, answer_twice], run))
    assert carried == [1, 2], "the second connection carries the POST and is kept alive for the GET"


def test_an_informational_answer_before_the_answer_is_skipped() -> None:
    async def continue_then_ok(head: Head, writer: asyncio.StreamWriter) -> None:
        await head()
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)
        await writer.drain()

    async def run(api: kube.ApiClient) -> None:
        assert await kube.request(api, "PUT", "/api/v1/nodes/a", body={}, timeout=5) == {"n": 1}

    assert asyncio.run(_serving([continue_then_ok], run)) == [1]


def test_a_chunked_answer_is_read_whole() -> None:
    async def chunked(head: Head, writer: asyncio.StreamWriter) -> None:
        await head()
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"4\r\n{\"n\"\r\n4\r\n: 2}\r\n0\r\n\r\n")
        await writer.drain()

    async def run(api: kube.ApiClient) -> None:
        assert await kube.request(api, "GET", "/api/v1/nodes/a", timeout=5) == {"n": 2}

    asyncio.run(_serving([chunked], run))


def test_an_answer_that_is_not_http_is_a_connection_error_and_a_write_is_not_repeated() -> None:
    async def garbage(head: Head, writer: asyncio.StreamWriter) -> None:
        await head()
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()

    async def run(api: kube.ApiClient) -> None:
        with pytest.raises(ConnectionError, match=r"not valid HTTP/1\.1"):
            await kube.request(api, "PATCH", "/api/v1/nodes/a", body={}, timeout=5)

    assert asyncio.run(_serving([garbage], run)) == [1]


def test_a_request_given_up_on_frees_its_connection() -> None:
    """With one connection allowed, a request that ran past its deadline must not keep it:
    the next request opens a fresh one and is answered."""
    never = asyncio.Event()

    async def silent(head: Head, writer: asyncio.StreamWriter) -> None:
        await head()
        await never.wait()

    async def answer(head: Head, writer: asyncio.StreamWriter) -> None:
        await head()
        writer.write(OK)
        await writer.drain()

    async def run(api: kube.ApiClient) -> None:
        with pytest.raises(TimeoutError):
            await kube.request(api, "POST", "/api/v1/namespaces/n/events", body={}, timeout=0.3)
        assert await kube.request(api, "GET", "/api/v1/nodes/a", timeout=5) == {"n": 1}
        never.set()

    assert asyncio.run(_serving([silent, answer], run, connections=1)) == [1, 1]


def test_a_connection_is_refused_clearly_and_repeated_even_for_a_write() -> None:
    """Nothing listens: the request never left, so even a POST is tried again, and the error
    names the address."""

    async def run() -> None:
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        api = kube.ApiClient(Credentials(f"http://127.0.0.1:{port}", False, static(None)))
        try:
            with pytest.raises(ConnectionError, match=re.escape(f"127.0.0.1:{port}")):
                await kube.request(api, "POST", "/api/v1/namespaces/n/events", body={}, timeout=10)
        finally:
            await api.close()

    asyncio.run(run())
