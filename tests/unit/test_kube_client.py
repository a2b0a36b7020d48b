"""dra_driver.kube against a real TLS server in a thread that answers from a script.

Each test scripts what the API server says (a 403 without a client certificate, a
certificate for another name, a 204 without Content-Length, a 429, a 503, a reset in the
middle of a watch, an ERROR event) and checks what the driver's client does with it. This
module must not talk to a real API server (tests/integration does) or sleep to wait for
anything: the server thread records each request, and tests read the record.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from controller.reconciler import SliceController
from dra_driver import kube
from dra_driver.kube.credentials import Credentials, static
from tests.harness.kubeconfig import write_kubeconfig

Reply = Callable[["_Handler"], None]
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
FORBIDDEN = {"kind": "Status", "code": 403, "message": 'User "system:anonymous" cannot get resource "nodes"'}


@dataclass(frozen=True)
class Seen:
    """One request as the server received it."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    client_port: int
    client_certificate: bool


@dataclass(frozen=True)
class Pki:
    ca: Path
    local: tuple[Path, Path]  # server certificate and key for IP 127.0.0.1
    named: tuple[Path, Path]  # server certificate and key for DNS api.internal only
    client: tuple[Path, Path]  # a client certificate the CA signed


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-subj", "/CN=test-ca", "-days", "1",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))  # fmt: skip

    def issue(name: str, subject: str, extensions: str) -> tuple[Path, Path]:
        (d / f"{name}.ext").write_text(extensions)
        _openssl(
            "req", *ec, "-subj", subject, "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr")
        )
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"),
                 "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "1",
                 "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.pem"))  # fmt: skip
        return d / f"{name}.pem", d / f"{name}.key"

    server = "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\nsubjectAltName="
    return Pki(
        ca=d / "ca.pem",
        local=issue("local", "/CN=local", server + "IP:127.0.0.1\n"),
        named=issue("named", "/CN=api.internal", server + "DNS:api.internal\n"),
        client=issue("client", "/CN=driver", "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n"),
    )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def _any(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        url = urlsplit(self.path)
        certificate = isinstance(self.connection, ssl.SSLSocket) and bool(self.connection.getpeercert())
        self.server.record(
            Seen(
                self.command,
                url.path,
                {k: v[0] for k, v in parse_qs(url.query).items()},
                {k.lower(): v for k, v in self.headers.items()},
                self.client_address[1],
                certificate,
            )
        )
        self.server.next_reply()(self)

    do_GET = do_POST = do_PUT = do_DELETE = _any

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, replies: list[Reply], context: ssl.SSLContext) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.socket = context.wrap_socket(self.socket, server_side=True)
        self.replies = list(replies)
        self.seen: list[Seen] = []
        self.changed = threading.Condition()

    def record(self, seen: Seen) -> None:
        with self.changed:
            self.seen.append(seen)
            self.changed.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that hangs up is no news
            super().handle_error(request, client_address)

    def next_reply(self) -> Reply:
        with self.changed:
            return self.replies.pop(0) if self.replies else answer(500, {"message": "the script has ended"})

    def wait_for(self, done: Callable[[list[Seen]], bool], seconds: float = 10.0) -> list[Seen]:
        with self.changed:
            if not self.changed.wait_for(lambda: done(self.seen), seconds):
                raise AssertionError(f"the server never saw what was awaited; it saw {self.seen}")
            return list(self.seen)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server_address[1]}"


def _context(certificate: tuple[Path, Path], pki: Pki) -> ssl.SSLContext:
    """Like kube-apiserver: a client certificate is checked if given, and not required for
    TLS (the request is answered 403 without one when the handler wants it)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca))
    context.verify_mode = ssl.CERT_OPTIONAL
    context.load_cert_chain(*map(str, certificate))
    return context


@pytest.fixture
def serve(pki: Pki) -> Iterator[Callable[..., _Server]]:
    started: list[_Server] = []

    def start(replies: list[Reply], certificate: tuple[Path, Path] | None = None) -> _Server:
        server = _Server(replies, _context(certificate or pki.local, pki))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


# --- scripted replies ----------------------------------------------------------------------


def answer(status: int, body: Any, headers: dict[str, str] | None = None) -> Reply:
    def reply(handler: _Handler) -> None:
        data = json.dumps(body).encode()
        handler.send_response(status)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    return reply


def raw(data: bytes) -> Reply:
    def reply(handler: _Handler) -> None:
        handler.wfile.write(data)

    return reply


def only_with_client_certificate(reply: Reply) -> Reply:
    def guarded(handler: _Handler) -> None:
        assert isinstance(handler.connection, ssl.SSLSocket)
        if handler.connection.getpeercert():
            reply(handler)
        else:
            answer(403, FORBIDDEN)(handler)

    return guarded


def only_with_token(token: str, reply: Reply) -> Reply:
    def guarded(handler: _Handler) -> None:
        if handler.headers.get("Authorization") == f"Bearer {token}":
            reply(handler)
        else:
            answer(401, {"kind": "Status", "code": 401, "message": "Unauthorized"})(handler)

    return guarded


def events(*items: tuple[str, Any], reset_when: threading.Event | None = None) -> Reply:
    """A watch answer, chunked, one event a chunk, finished; or, with `reset_when`, the
    connection aborted with a TCP reset once that is set (a reset any sooner can take the
    events still in flight with it)."""

    def reply(handler: _Handler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        for kind, obj in items:
            line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        if reset_when is None:
            handler.wfile.write(b"0\r\n\r\n")
            return
        assert reset_when.wait(10), "the client never got the events"
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        handler.close_connection = True
        handler.connection.close()

    return reply


def _slice(name: str, version: str) -> dict[str, Any]:
    return {"kind": "ResourceSlice", "metadata": {"name": name, "resourceVersion": version}}


# --- clients -------------------------------------------------------------------------------


def _data(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _trusting(server: _Server, pki: Pki) -> kube.ApiClient:
    context = ssl.create_default_context(cafile=str(pki.ca))
    return kube.ApiClient(Credentials(server.url, context, static(None)))


async def _closing(api: kube.ApiClient, work: Callable[[kube.ApiClient], Any]) -> Any:
    try:
        return await work(api)
    finally:
        await api.close()


# --- credentials ---------------------------------------------------------------------------


def test_insecure_skip_tls_verify_still_presents_the_client_certificate(
    tmp_path: Path, pki: Pki, serve: Callable[..., _Server]
) -> None:
    """(a) Skipping the check of the server's certificate is no reason to stop saying who we are."""
    server = serve([only_with_client_certificate(answer(200, {"kind": "Node"}))])
    cert, key = pki.client
    path = write_kubeconfig(
        tmp_path / "config",
        {"server": server.url, "insecure-skip-tls-verify": True},
        {"client-certificate-data": _data(cert), "client-key-data": _data(key)},
    )

    async def run() -> Any:
        api = await kube.load_client(str(path))
        return await _closing(api, lambda api: kube.request(api, "GET", "/api/v1/nodes/n", timeout=10))

    assert asyncio.run(run()) == {"kind": "Node"}
    assert server.seen[0].client_certificate


def test_tls_server_name_is_the_name_the_certificate_is_checked_against(
    tmp_path: Path, pki: Pki, serve: Callable[..., _Server]
) -> None:
    """(b) The server's certificate names api.internal only; we dial 127.0.0.1."""
    server = serve([answer(200, {"kind": "Node"})], certificate=pki.named)
    path = write_kubeconfig(
        tmp_path / "config",
        {"server": server.url, "certificate-authority": str(pki.ca), "tls-server-name": "api.internal"},
        {"token": "t0"},
    )

    async def run(config: Path) -> Any:
        api = await kube.load_client(str(config))
        return await _closing(api, lambda api: kube.request(api, "GET", "/api/v1/nodes/n", timeout=10))

    assert asyncio.run(run(path)) == {"kind": "Node"}
    assert server.seen[0].headers["authorization"] == "Bearer t0"
    without = write_kubeconfig(
        tmp_path / "without", {"server": server.url, "certificate-authority": str(pki.ca)}, {"token": "t0"}
    )
    with pytest.raises(ssl.SSLCertVerificationError):
        asyncio.run(run(without))  # the check is still made, against the name given


def test_an_exec_plugin_token_is_sent_and_fetched_again(
    tmp_path: Path, pki: Pki, serve: Callable[..., _Server], monkeypatch: pytest.MonkeyPatch
) -> None:
    """(c) A kubeconfig whose user is an exec credential plugin (a tiny script)."""
    (tmp_path / "token").write_text("first")
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import json, pathlib, sys\n"
        "token = pathlib.Path(sys.argv[1]).read_text()\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': 'ExecCredential',"
        " 'status': {'token': token}}))\n"
    )
    server = serve(
        [
            only_with_token("first", answer(200, {"n": 1})),
            only_with_token("second", answer(200, {"n": 2})),
        ]
    )
    path = write_kubeconfig(
        tmp_path / "config",
        {"server": server.url, "certificate-authority-data": _data(pki.ca)},
        {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1",
                "command": sys.executable,
                "args": [str(plugin), str(tmp_path / "token")],
                "interactiveMode": "Never",
            }
        },
    )

    async def run() -> list[Any]:
        api = await kube.load_client(str(path))
        try:
            first = await kube.request(api, "GET", "/version", timeout=10)
            (tmp_path / "token").write_text("second")
            monkeypatch.setattr("dra_driver.kube.credentials.TOKEN_REREAD_SECONDS", -1.0)
            return [first, await kube.request(api, "GET", "/version", timeout=10)]
        finally:
            await api.close()

    assert asyncio.run(run()) == [{"n": 1}, {"n": 2}]


# --- transport -----------------------------------------------------------------------------


def test_a_204_without_content_length_does_not_wait_for_the_connection_to_end(
    pki: Pki, serve: Callable[..., _Server]
) -> None:
    """(d) A 204 has no body by definition; the connection stays open and is used again."""
    server = serve([raw(b"HTTP/1.1 204 No Content\r\n\r\n"), answer(200, {"kind": "Status"})])

    async def run(api: kube.ApiClient) -> list[Any]:
        return [
            await kube.request(api, "DELETE", "/api/v1/namespaces/n/events/e", timeout=5),
            await kube.request(api, "GET", "/api/v1/namespaces/n/events/e", timeout=5),
        ]

    assert asyncio.run(_closing(_trusting(server, pki), run)) == [{}, {"kind": "Status"}]
    first, second = server.seen
    assert first.client_port == second.client_port, "the keep-alive connection was not used again"


def test_a_client_opens_at_most_its_connections(pki: Pki, serve: Callable[..., _Server]) -> None:
    """A burst past the cap waits for a free connection (the node's client: fewer TLS
    buffers held); the same burst with room opens one connection per request."""

    def ports_for(connections: int) -> set[int]:
        server = serve([answer(200, {"n": i}) for i in range(6)])
        context = ssl.create_default_context(cafile=str(pki.ca))
        api = kube.ApiClient(Credentials(server.url, context, static(None)), connections=connections)

        async def run(api: kube.ApiClient) -> list[Any]:
            return list(await asyncio.gather(*(
                kube.request(api, "GET", f"/api/v1/namespaces/n/events/e{i}", timeout=5) for i in range(6)
            )))

        assert sorted(r["n"] for r in asyncio.run(_closing(api, run))) == list(range(6))
        return {s.client_port for s in server.seen}

    assert len(ports_for(2)) <= 2
    assert len(ports_for(6)) > 2


def test_a_429_is_retried_after_its_retry_after(pki: Pki, serve: Callable[..., _Server]) -> None:
    """(e) Even a POST: API Priority and Fairness rejected it before acting on it."""
    busy = {"kind": "Status", "code": 429, "reason": "TooManyRequests"}
    server = serve([answer(429, busy, {"Retry-After": "1"}), answer(201, {"kind": "Event"})])

    async def run(api: kube.ApiClient) -> tuple[Any, float]:
        started = time.monotonic()
        created = await kube.request(api, "POST", "/api/v1/namespaces/n/events", body={}, timeout=10)
        return created, time.monotonic() - started

    created, waited = asyncio.run(_closing(_trusting(server, pki), run))
    assert created == {"kind": "Event"}
    assert waited >= 0.95
    assert [s.method for s in server.seen] == ["POST", "POST"]


def test_a_retry_after_past_the_deadline_is_an_error_at_once(pki: Pki, serve: Callable[..., _Server]) -> None:
    server = serve([answer(429, {"code": 429}, {"Retry-After": "5"})])

    async def run(api: kube.ApiClient) -> float:
        started = time.monotonic()
        with pytest.raises(kube.ApiException) as raised:
            await kube.request(api, "GET", "/api/v1/nodes", timeout=2)
        assert raised.value.status == 429
        return time.monotonic() - started

    assert asyncio.run(_closing(_trusting(server, pki), run)) < 2
    assert len(server.seen) == 1


def test_a_503_is_retried_for_a_get(pki: Pki, serve: Callable[..., _Server]) -> None:
    """(f) A GET changes nothing, so asking again is safe."""
    server = serve([answer(503, {"code": 503}), answer(502, {"code": 502}), answer(200, {"items": []})])

    async def run(api: kube.ApiClient) -> Any:
        return await kube.request(api, "GET", SLICES, timeout=10)

    assert asyncio.run(_closing(_trusting(server, pki), run)) == {"items": []}
    assert len(server.seen) == 3


def test_a_503_is_not_retried_for_a_write(pki: Pki, serve: Callable[..., _Server]) -> None:
    """The server may have created the object before it failed: the caller decides."""
    server = serve([answer(503, {"code": 503}), answer(201, {})])

    async def run(api: kube.ApiClient) -> None:
        with pytest.raises(kube.ApiException) as raised:
            await kube.request(api, "POST", SLICES, body={}, timeout=10)
        assert raised.value.status == 503

    asyncio.run(_closing(_trusting(server, pki), run))
    assert len(server.seen) == 1


def test_a_reset_in_the_middle_of_a_watch_resumes_from_the_last_version(
    pki: Pki, serve: Callable[..., _Server]
) -> None:
    """(g) The connection breaks after one event; the watch opens again from that event's
    resourceVersion, and the consumer sees nothing but the events."""
    received = threading.Event()
    server = serve(
        [
            events(("ADDED", _slice("a", "11")), reset_when=received),
            events(("MODIFIED", _slice("a", "12"))),
        ]
    )

    async def run(api: kube.ApiClient) -> list[tuple[str, str]]:
        seen = []
        async for kind, obj in kube.watch(api, SLICES, "10", timeout_seconds=20):
            seen.append((kind, obj["metadata"]["resourceVersion"]))
            received.set()
        return seen

    assert asyncio.run(_closing(_trusting(server, pki), run)) == [("ADDED", "11"), ("MODIFIED", "12")]
    assert [s.query["resourceVersion"] for s in server.seen] == ["10", "11"]
    assert server.seen[0].client_port != server.seen[1].client_port


def test_a_watch_error_410_is_raised_and_the_publisher_lists_again(
    pki: Pki, serve: Callable[..., _Server]
) -> None:
    """(h) An expired resourceVersion: the watch raises ApiException 410, and the slice
    publisher answers it with a new list."""
    gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version: 1 (7)"}
    listing = {"kind": "ResourceSliceList", "metadata": {"resourceVersion": "1"}, "items": []}
    server = serve([events(("ERROR", gone))])

    async def watch_once(api: kube.ApiClient) -> None:
        with pytest.raises(kube.ApiException) as raised:
            async for _ in kube.watch(api, SLICES, "1"):
                pass
        assert raised.value.status == 410
        assert "too old resource version" in str(raised.value)

    asyncio.run(_closing(_trusting(server, pki), watch_once))

    server = serve([answer(200, listing), events(("ERROR", gone)), answer(200, listing), events()])

    async def publish(api: kube.ApiClient) -> None:
        task = asyncio.create_task(SliceController(api=api, driver="gpu.example", pools={}).run())
        try:
            await asyncio.to_thread(
                server.wait_for, lambda seen: sum("watch" not in s.query for s in seen) >= 2
            )
        finally:
            task.cancel()

    asyncio.run(_closing(_trusting(server, pki), publish))
    kinds = ["watch" if "watch" in s.query else "list" for s in server.seen[:3]]
    assert kinds == ["list", "watch", "list"]


def test_one_attempt_is_not_retried_even_on_a_429(pki: Pki, serve: Callable[..., _Server]) -> None:
    """A caller that retries itself (the claim status queue) asks for one attempt: one retry layer."""
    server = serve([answer(429, {"code": 429}, {"Retry-After": "1"}), answer(201, {"kind": "Event"})])

    async def run(api: kube.ApiClient) -> None:
        with pytest.raises(kube.ApiException) as raised:
            await kube.request(api, "POST", "/api/v1/namespaces/n/events", body={}, timeout=10, attempts=1)
        assert raised.value.status == 429 and raised.value.retry_after == 1

    asyncio.run(_closing(_trusting(server, pki), run))
    assert [s.method for s in server.seen] == ["POST"]
