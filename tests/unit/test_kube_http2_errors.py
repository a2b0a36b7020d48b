"""dra_driver.kube.http2 against an HTTP/2 server made with h2 itself, in the test's event
loop, TLS with ALPN "h2" on 127.0.0.1: what a real API server will not do on demand.

GOAWAY (requests past its last stream id were not processed: repeated, even a POST, on a
new connection; a GET up to it is repeated too, a POST is not), a stream reset (a GET is
repeated, a POST is not; REFUSED_STREAM is repeated for any method), the connection
dropped in the middle of a body (likewise), large bodies past every window while other
answers are held unread, bodies refused past `max_bytes` many times over without the
connection's window running out, and a TLS server that chooses HTTP/1.1. This module must
not talk to a real API server (tests/integration/test_kube_http2.py does).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import hyperframe.frame
import pytest

from dra_driver import kube
from dra_driver.kube import http2, transport
from dra_driver.kube.credentials import Credentials, static
from tests.harness.objects import wait_for_async


@dataclass
class Peer:
    """One client connection, server side."""

    h2: h2.connection.H2Connection
    writer: asyncio.StreamWriter
    index: int  # 0 for the first connection the server accepted
    window: asyncio.Event = field(default_factory=asyncio.Event)

    def flush(self) -> None:
        self.writer.write(self.h2.data_to_send())

    def head(self, stream: int, status: int = 200, length: int | None = None) -> None:
        headers = [(":status", str(status)), ("content-type", "application/json")]
        if length is not None:
            headers.append(("content-length", str(length)))
        self.h2.send_headers(stream, headers)
        self.flush()

    async def body(self, stream: int, data: bytes, end: bool = True) -> None:
        """Send `data` as the client's windows allow (h2 refuses to send past them)."""
        view = memoryview(data)
        while view:
            size = min(len(view), self.h2.local_flow_control_window(stream), self.h2.max_outbound_frame_size)
            if size == 0:
                self.window.clear()
                await self.window.wait()
                continue
            self.h2.send_data(stream, view[:size].tobytes())
            view = view[size:]
            self.flush()
            await self.writer.drain()
        if end:
            self.h2.end_stream(stream)
            self.flush()

    async def answer(self, stream: int, data: bytes = b'{"n": 1}') -> None:
        self.head(stream, length=len(data))
        await self.body(stream, data)


# A request as the server got it: (peer, stream id, method, path, body).
Handler = Callable[[Peer, int, str, str, bytes], Awaitable[None]]


@dataclass
class H2Server:
    handler: Handler
    seen: list[tuple[int, str, str]] = field(default_factory=list)  # (connection, method, path)
    connections: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        config = h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        peer = Peer(h2.connection.H2Connection(config), writer, self.connections)
        self.connections += 1
        peer.h2.initiate_connection()
        peer.flush()
        heads: dict[int, tuple[str, str]] = {}
        bodies: dict[int, bytearray] = {}
        try:
            while data := await reader.read(2**16):
                for event in peer.h2.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        fields = dict(event.headers or [])
                        heads[event.stream_id] = (str(fields[":method"]), str(fields[":path"]))
                        bodies[event.stream_id] = bytearray()
                    elif isinstance(event, h2.events.DataReceived):
                        bodies[event.stream_id] += event.data
                        peer.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, h2.events.StreamEnded) and event.stream_id in heads:
                        method, path = heads[event.stream_id]
                        self.seen.append((peer.index, method, path))
                        task = asyncio.create_task(
                            self.handler(peer, event.stream_id, method, path, bytes(bodies[event.stream_id]))
                        )
                        self.tasks.add(task)
                        task.add_done_callback(self.tasks.discard)
                    elif isinstance(event, h2.events.WindowUpdated):
                        peer.window.set()
                peer.flush()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("h2pki")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-subj", "/CN=local", "-days", "1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
                   check=True, capture_output=True)  # fmt: skip
    return d / "cert.pem", d / "key.pem"


async def _serving(
    certificate: tuple[Path, Path],
    h2server: H2Server,
    run: Callable[[kube.ApiClient], Awaitable[None]],
    alpn: tuple[str, ...] = ("h2",),
    serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]] | None = None,
    http2: bool | None = True,  # the server is near: HTTP/2 only when asked for
) -> None:
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(*certificate)
    server_context.set_alpn_protocols(list(alpn))
    listener = await asyncio.start_server(serve or h2server.serve, "127.0.0.1", 0, ssl=server_context)
    port = listener.sockets[0].getsockname()[1]
    context = ssl.create_default_context(cafile=str(certificate[0]))
    api = kube.ApiClient(Credentials(f"https://127.0.0.1:{port}", context, static(None)), http2=http2)
    try:
        await run(api)
    finally:
        await api.close()
        listener.close()
        for task in list(h2server.tasks):
            task.cancel()
        await asyncio.gather(*h2server.tasks, return_exceptions=True)


def test_a_goaway_repeats_what_it_did_not_take_and_what_a_get_asked(certificate: tuple[Path, Path]) -> None:
    """A GET, then a POST, then two more POSTs, on one connection; the server says GOAWAY
    with the first POST's stream as the last it took: the two after it were not processed
    and are sent again on a new connection, as is the GET; the POST it took may have been
    applied and is an error to its caller, not repeated."""
    four = asyncio.Event()
    streams: dict[str, int] = {}

    async def handler(peer: Peer, stream: int, method: str, path: str, body: bytes) -> None:
        if peer.index > 0:
            await peer.answer(stream, b'{"n": 2}')
            return
        streams[path] = stream
        if len(streams) == 4:
            four.set()
        await four.wait()
        if path == "/a":
            goaway = hyperframe.frame.GoAwayFrame(0)
            goaway.last_stream_id, goaway.error_code = stream, 0
            peer.flush()
            peer.writer.write(goaway.serialize())

    server = H2Server(handler)

    async def run(api: kube.ApiClient) -> None:
        def call(method: str, path: str) -> asyncio.Task[kube.JSON]:
            return asyncio.create_task(kube.request(api, method, path, body=None if method == "GET" else {},
                                                    timeout=10))

        tasks = []
        for n, (method, path) in enumerate([("GET", "/g"), ("POST", "/a"), ("POST", "/b"), ("POST", "/c")]):
            tasks.append(call(method, path))
            await wait_for_async(f"request {n + 1} at the server", lambda n=n: len(server.seen) > n)
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert done[0] == done[2] == done[3] == {"n": 2}, done
        assert isinstance(done[1], ConnectionError) and "GOAWAY" in str(done[1]), done[1]
        assert api._pool.protocol == "h2"

    asyncio.run(_serving(certificate, server, run))
    assert server.connections == 2
    assert sorted(p for c, _, p in server.seen if c == 1) == ["/b", "/c", "/g"]


@pytest.mark.parametrize(
    ("method", "code", "repeated"),
    [
        ("GET", h2.errors.ErrorCodes.INTERNAL_ERROR, True),
        ("POST", h2.errors.ErrorCodes.INTERNAL_ERROR, False),
        ("POST", h2.errors.ErrorCodes.REFUSED_STREAM, True),
    ],
)
def test_a_reset_stream_is_repeated_only_where_that_is_safe(
    certificate: tuple[Path, Path], method: str, code: h2.errors.ErrorCodes, repeated: bool
) -> None:
    """A reset after part of the body (a GET repeated, a POST not) or REFUSED_STREAM (not
    processed: any method repeated); the connection goes on carrying the other streams."""

    async def handler(peer: Peer, stream: int, method_: str, path: str, body: bytes) -> None:
        if path.endswith("/ok") or [p for _, _, p in server.seen].count(path) > 1:
            await peer.answer(stream)
            return
        if code != h2.errors.ErrorCodes.REFUSED_STREAM:
            peer.head(stream, length=100)
            await peer.body(stream, b'{"n": ', end=False)
        peer.h2.reset_stream(stream, code)
        peer.flush()

    async def run(api: kube.ApiClient) -> None:
        call = kube.request(api, method, "/api/v1/namespaces/n/x", body=None if method == "GET" else {},
                            timeout=10)
        if repeated:
            assert await call == {"n": 1}
        else:
            with pytest.raises(ConnectionError, match="reset"):
                await call
        assert await kube.request(api, "GET", "/api/v1/ok", timeout=10) == {"n": 1}

    server = H2Server(handler)
    asyncio.run(_serving(certificate, server, run))
    assert server.connections == 1, "a reset stream does not end the connection"
    assert [p for _, _, p in server.seen].count("/api/v1/namespaces/n/x") == (2 if repeated else 1)


@pytest.mark.parametrize(("method", "repeated"), [("GET", True), ("PATCH", False)])
def test_a_connection_dropped_in_the_middle_of_a_body(
    certificate: tuple[Path, Path], method: str, repeated: bool
) -> None:
    async def handler(peer: Peer, stream: int, method_: str, path: str, body: bytes) -> None:
        if peer.index > 0:
            await peer.answer(stream)
            return
        peer.head(stream, length=2**20)
        await peer.body(stream, b"x" * 100_000, end=False)
        await peer.writer.drain()
        peer.writer.transport.abort()

    async def run(api: kube.ApiClient) -> None:
        call = kube.request(api, method, "/api/v1/nodes/a", body=None if method == "GET" else {}, timeout=10)
        if repeated:
            assert await call == {"n": 1}
        else:
            with pytest.raises(ConnectionError):
                await call

    server = H2Server(handler)
    asyncio.run(_serving(certificate, server, run))
    assert len(server.seen) == (2 if repeated else 1)


def test_large_bodies_pass_every_window_while_other_answers_are_held_unread(
    certificate: tuple[Path, Path],
) -> None:
    """Eight answers of 1 MiB whose readers do not read yet fill their streams' windows and
    no more: a 3 MiB answer still comes whole, and so do the held ones afterwards."""
    big = {path: (f'{{"p": "{path}", "x": "' + "y" * size + '"}').encode()
           for path, size in [(f"/h{i}", 2**20) for i in range(8)] + [("/big", 3 * 2**20)]}

    async def handler(peer: Peer, stream: int, method: str, path: str, body: bytes) -> None:
        await peer.answer(stream, big[path])

    async def run(api: kube.ApiClient) -> None:
        held = [await api.send("GET", f"/h{i}", None, None, "") for i in range(8)]
        got = await kube.request(api, "GET", "/big", timeout=20)
        assert got["p"] == "/big" and len(got["x"]) == 3 * 2**20
        for i, response in enumerate(held):
            async with response:
                data = b"".join([chunk async for chunk in response.chunks()])
            assert data == big[f"/h{i}"]

    server = H2Server(handler)
    asyncio.run(_serving(certificate, server, run))
    assert server.connections == 1


def test_answers_refused_past_max_bytes_give_their_window_back(certificate: tuple[Path, Path]) -> None:
    """Each of many answers larger than `max_bytes` is cut off (TooLarge) with data still on
    the way; what it left unread goes back to the connection's window, or the connection
    would stall after MAX_STREAMS * STREAM_WINDOW bytes of them."""
    size = 2 * http2.STREAM_WINDOW
    rounds = 2 * http2.MAX_STREAMS

    async def handler(peer: Peer, stream: int, method: str, path: str, body: bytes) -> None:
        if path == "/ok":
            await peer.answer(stream)
            return
        peer.head(stream)  # no content-length: the client finds out by reading
        with contextlib.suppress(h2.exceptions.StreamClosedError):  # the client reset it
            await peer.body(stream, b"z" * size)

    async def run(api: kube.ApiClient) -> None:
        for _ in range(rounds):
            with pytest.raises(kube.TooLarge):
                await kube.request(api, "GET", "/large", timeout=10, max_bytes=1)
        assert await kube.request(api, "GET", "/ok", timeout=10) == {"n": 1}
        shared = api._pool._shared_connection
        assert shared is not None
        window = shared._h2.inbound_flow_control_window  # what the server may still send
        assert window >= http2.MAX_STREAMS * http2.STREAM_WINDOW // 2, window

    server = H2Server(handler)
    asyncio.run(_serving(certificate, server, run))
    assert server.connections == 1


def test_a_tls_server_that_chooses_http_1_1_is_spoken_to_in_http_1_1(certificate: tuple[Path, Path]) -> None:
    async def http11(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n{\"n\": 3}")
        await writer.drain()
        writer.close()

    async def unused(peer: Peer, stream: int, method: str, path: str, body: bytes) -> None:
        raise AssertionError("not an HTTP/2 server")

    async def run(api: kube.ApiClient) -> None:
        assert await kube.request(api, "GET", "/api/v1/nodes/a", timeout=10) == {"n": 3}
        assert api._pool.protocol == "http/1.1"

    asyncio.run(_serving(certificate, H2Server(unused), run, alpn=("http/1.1",), serve=http11))


def test_a_near_server_that_offers_http2_is_spoken_to_in_http_1_1_unless_asked(
    certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its first connection opened in under FAR_HANDSHAKE_SECONDS (made long here, so that a
    loaded machine's slow handshake does not count as far): that connection is closed unused
    and the next ones offer only HTTP/1.1, which the server then speaks."""
    monkeypatch.setattr(transport, "FAR_HANDSHAKE_SECONDS", 5.0)
    opened: list[str | None] = []

    async def either(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ssl_object = writer.get_extra_info("ssl_object")
        opened.append(ssl_object.selected_alpn_protocol())
        if opened[-1] == "h2":
            writer.close()
            return
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n{\"n\": 4}")
        await writer.drain()

    async def unused(peer: Peer, stream: int, method: str, path: str, body: bytes) -> None:
        raise AssertionError("not an HTTP/2 server")

    async def run(api: kube.ApiClient) -> None:
        reads = (kube.request(api, "GET", "/api/v1/nodes/a", timeout=10) for _ in range(3))
        got = await asyncio.gather(*reads)
        assert got == [{"n": 4}] * 3
        assert api._pool.protocol == "http/1.1"

    server = H2Server(unused)
    asyncio.run(_serving(certificate, server, run, alpn=("h2", "http/1.1"), serve=either, http2=None))
    assert opened[0] == "h2" and set(opened[1:]) == {"http/1.1"}, opened
