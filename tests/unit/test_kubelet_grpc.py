"""The kubelet's gRPC on the plugin's DRA socket holds up against clients that misbehave.

Each test is a failure the plugin's earlier hand-written HTTP/2 server (dra_driver/rpc,
until e84c1ef) had, checked against the real SocketServer and DRA services (a fake
preparer behind them) in a process of their own (grpc_server_process.py):

- an error status longer than one HTTP/2 frame (a call of an unknown method with a long
  path) reaches the kubelet's own client library, grpc-go, as that call's status, and a
  Prepare in flight on the same connection still succeeds (the old server sent it as one
  oversized frame, and grpc-go dropped the connection with every call on it);
- a client that floods PING or SETTINGS frames and never reads what it is answered
  cannot make the server's memory grow without bound, and other clients are still served;
- a request whose body never completes ends at its deadline (grpc-timeout), while other
  calls on the same connection and on others are answered;
- a request that is not a protobuf message gets an error status, and the server serves on;
- stop() removes the socket it bound, and only that one: a socket or file that has
  replaced it at the path (a newer instance's, during a rolling update) is left alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import socket as socketlib
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from dra_driver.kubeletapi.dra.v1 import api_pb2 as dra_v1
from dra_driver.kubeletapi.dra.v1 import api_pb2_grpc as dra_v1_grpc
from dra_driver.plugin.server import SocketServer
from dra_driver.plugin.service import add_dra_services
from tests.harness.objects import wait_steady

REPO = Path(__file__).resolve().parents[2]
SERVER_SCRIPT = Path(__file__).with_name("grpc_server_process.py")
PREPARE = f"/{dra_v1.DESCRIPTOR.services_by_name['DRAPlugin'].full_name}/NodePrepareResources"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@dataclass(frozen=True)
class Served:
    socket: Path
    pid: int
    log: Path


def spawn_server(
    socket: Path, log: Path, *args: str, preexec: Callable[[], None] | None = None
) -> subprocess.Popen[str]:
    """grpc_server_process.py serving on `socket` (its stderr in `log`), once it said so."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(SERVER_SCRIPT), str(socket), *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=env, text=True,
            preexec_fn=preexec,
        )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("ready "), f"the server did not start ({line!r}):\n{log.read_text()}"
    except BaseException:
        stop_server(proc)
        raise
    return proc


def stop_server(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def served() -> Iterator[Served]:
    """grpc_server_process.py serving on a fresh socket; its log is shown if a test fails."""
    with tempfile.TemporaryDirectory(prefix="kgrpc-") as directory:  # tmp_path can exceed 107 bytes
        socket, log = Path(directory) / "dra.sock", Path(directory) / "server.log"
        proc = spawn_server(socket, log)
        try:
            yield Served(socket, proc.pid, log)
            assert proc.poll() is None, f"the server died (exit {proc.returncode}):\n{log.read_text()}"
        finally:
            stop_server(proc)


def _claims(*names: str) -> Any:
    return dra_v1.NodePrepareResourcesRequest(
        claims=[dra_v1.Claim(namespace="ns", name=n, uid=f"uid-{i}") for i, n in enumerate(names)]
    )


def _prepare_succeeds(socket: Path) -> None:
    """A normal Prepare from a fresh grpcio client is answered, claim by claim."""
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        answer = dra_v1_grpc.DRAPluginStub(channel).NodePrepareResources(_claims("ok", "bad"), timeout=10)
    assert answer.claims["uid-0"].error == ""
    assert answer.claims["uid-1"].error == "refused"


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


# -- 1. a long error status, through grpc-go ---------------------------------------------


@pytest.fixture(scope="module")
def kubelet_client() -> Path:
    """benchmarks/kubeletclient (grpc-go, as the kubelet), built by hack/bench/build.sh."""
    if shutil.which("go") is None:
        pytest.skip("needs the Go toolchain to build benchmarks/kubeletclient (the kubelet's grpc-go client)")
    from benchmarks.kubelet_client import build

    return build()


def test_a_long_error_status_fails_only_its_own_call_in_grpc_go(served: Served, kubelet_client: Path) -> None:
    """The unknown method's path comes back in the status message; '%' is sent as '%25',
    so a path of 7000 bytes (within every header limit) makes a message of over 21 KiB,
    more than one HTTP/2 frame (16 KiB) and so a header block grpc-go must receive in
    CONTINUATION frames. The Prepare in flight meanwhile (2 s) must still succeed."""
    path = PREPARE.rsplit("/", 1)[0] + "/" + "%" * 7000
    done = subprocess.run(
        [str(kubelet_client), "-socket", str(served.socket), "-side-call", path, "-side-call-lead", "500ms"],
        input=json.dumps([{"namespace": "ns", "name": "slow", "uid": "uid-slow"}]),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"kubelet-client failed (exit {done.returncode}):\n{done.stderr}"
    result = json.loads(done.stdout)
    assert result["prepare"] == {"ok": True, "error": ""}, (
        f"the Prepare in flight on the same grpc-go connection failed: {result}"
    )
    assert result["side_call"]["code"] == "Unimplemented", result


# -- 2. control frames from a client that never reads -------------------------------------


def _flood(socket: Path, frame: bytes, seconds: float) -> tuple[socketlib.socket, int, str]:
    """Send `frame` over and over on one connection for `seconds`, never reading.

    Returns the connection (still open, unless the server closed it), the bytes sent,
    and how the flood ended."""
    conn = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    conn.setsockopt(socketlib.SOL_SOCKET, socketlib.SO_RCVBUF, 4096)  # what the server answers piles up
    conn.connect(str(socket))
    conn.sendall(PREFACE + _frame(0x4, 0, 0, b""))  # preface, empty SETTINGS
    conn.setblocking(False)
    batch = frame * 2048
    pending, sent = b"", 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not pending:
            pending = batch
        try:
            n = conn.send(pending)
        except BlockingIOError:
            select.select([], [conn], [], 0.05)
            continue
        except (BrokenPipeError, ConnectionResetError) as e:
            return conn, sent, f"the server closed the connection ({type(e).__name__}) after {sent} bytes"
        pending, sent = pending[n:], sent + n
    return conn, sent, f"flooded for {seconds} s, {sent} bytes"


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(_frame(0x6, 0, 0, b"12345678"), id="ping"),
        pytest.param(_frame(0x4, 0, 0, struct.pack(">HI", 0x4, 65_535)), id="settings"),
    ],
)
def test_a_client_that_floods_control_frames_and_never_reads_gets_bounded_memory(
    served: Served, kind: bytes
) -> None:
    _prepare_succeeds(served.socket)  # grpcio's server and our handlers warmed up
    before = wait_steady("the server's RSS after the warm-up", lambda: _rss_kib(served.pid), 256)
    conn, _, how = _flood(served.socket, kind, seconds=6)
    try:
        after = _rss_kib(served.pid)
        _prepare_succeeds(served.socket)
    finally:
        conn.close()
    grown = (after - before) / 1024
    assert grown < 10, f"the server's RSS grew by {grown:.1f} MiB ({before} -> {after} KiB); {how}"


# -- 3. a request body that never completes ---------------------------------------------


def _request_headers(path: str, timeout: str | None) -> list[tuple[str, str]]:
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    return [*headers, ("grpc-timeout", timeout)] if timeout else headers


def _grpc_framed(message: Any) -> bytes:
    payload: bytes = message.SerializeToString()
    return b"\x00" + struct.pack(">I", len(payload)) + payload


def test_a_request_whose_body_never_completes_ends_at_its_deadline(served: Served) -> None:
    """HEADERS with grpc-timeout 1S and a DATA frame holding 2 of the 100 bytes its gRPC
    prefix announces, no END_STREAM: the server must end the stream (DEADLINE_EXCEEDED or
    RST_STREAM) by itself; a whole call on the same connection is answered
    meanwhile, and so is one from another client."""
    conn = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    conn.connect(str(served.socket))
    h2conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    h2conn.initiate_connection()
    stuck = h2conn.get_next_available_stream_id()
    h2conn.send_headers(stuck, _request_headers(PREPARE, "1S"))
    h2conn.send_data(stuck, b"\x00\x00\x00\x00\x64" + b"\x0a\x05")
    whole = h2conn.get_next_available_stream_id()
    h2conn.send_headers(whole, _request_headers(PREPARE, "10S"))
    h2conn.send_data(whole, _grpc_framed(_claims("ok")), end_stream=True)
    conn.sendall(h2conn.data_to_send())
    start = time.monotonic()
    other_error: list[BaseException] = []
    other = threading.Thread(target=_capture, args=(other_error, _prepare_succeeds, served.socket))
    other.start()

    status: dict[int, dict[str, str]] = {stuck: {}, whole: {}}
    ended: dict[int, tuple[float, str]] = {}
    limit = 30.0  # generous for a loaded machine: the old server never ended the call at all
    try:
        while len(ended) < 2 and time.monotonic() - start < limit:
            readable, _, _ = select.select([conn], [], [], limit - (time.monotonic() - start))
            if not readable:
                break
            data = conn.recv(65_536)
            if not data:
                for s in status:
                    ended.setdefault(s, (time.monotonic() - start, "connection closed"))
                break
            for event in h2conn.receive_data(data):
                elapsed = time.monotonic() - start
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    status[event.stream_id].update(dict(event.headers))  # type: ignore[arg-type]
                elif isinstance(event, h2.events.StreamEnded):
                    ended.setdefault(event.stream_id, (elapsed, "ended"))
                elif isinstance(event, h2.events.StreamReset):
                    ended.setdefault(event.stream_id, (elapsed, f"reset ({event.error_code!r})"))
                elif isinstance(event, h2.events.ConnectionTerminated):
                    for s in status:
                        ended.setdefault(s, (elapsed, f"GOAWAY ({event.error_code!r})"))
            conn.sendall(h2conn.data_to_send())
    finally:
        conn.close()
        other.join(15)

    assert not other_error, f"a call from another client failed meanwhile: {other_error[0]!r}"
    assert whole in ended and status[whole].get("grpc-status") == "0", (
        f"the whole call on the same connection was not answered: {ended.get(whole)}, {status[whole]}"
    )
    assert stuck in ended, (
        f"the call with an incomplete body and a 1 s deadline was still open after {limit} s "
        f"(headers so far: {status[stuck]})"
    )
    _, how = ended[stuck]
    assert how.startswith("reset") or status[stuck].get("grpc-status") == "4", (
        f"the incomplete call ended {how} with {status[stuck]}, not DEADLINE_EXCEEDED"
    )


def _capture(errors: list[BaseException], call: Any, *args: Any) -> None:
    try:
        call(*args)
    except BaseException as e:  # reported by the test's thread
        errors.append(e)


# -- 4. a request that is not a protobuf message -----------------------------------------


def test_a_malformed_request_gets_an_error_status_and_the_server_serves_on(served: Served) -> None:
    with grpc.insecure_channel(f"unix://{served.socket}") as channel:
        raw = channel.unary_unary(PREPARE)  # no serializers: the bytes go as they are
        with pytest.raises(grpc.RpcError) as failed:
            raw(b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", timeout=10)
        # grpc.aio answers UNKNOWN ("Unexpected DecodeError: Error parsing message with type ...")
        refused = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
        assert failed.value.code() in refused, failed.value
        assert "NodePrepareResourcesRequest" in (failed.value.details() or ""), failed.value
        answer = dra_v1_grpc.DRAPluginStub(channel).NodePrepareResources(_claims("ok"), timeout=10)
        assert answer.claims["uid-0"].error == ""
    _prepare_succeeds(served.socket)


# -- 5. stop() and a socket that has replaced ours ----------------------------------------


class _NoPreparer:
    async def prepare(self, refs: Any) -> dict[str, Any]:
        return {}

    async def unprepare(self, refs: Any) -> dict[str, Any]:
        return {}


class _NoBoard:
    async def follow(self) -> Any:
        await asyncio.Event().wait()
        yield ()


def _server() -> SocketServer:
    return SocketServer("dra", lambda s: add_dra_services(s, _NoPreparer(), _NoBoard()))  # type: ignore[arg-type]


def test_stop_removes_its_own_socket() -> None:
    async def main(path: Path) -> None:
        server = _server()
        await server.start(path)
        assert path.is_socket()
        await server.stop(None)
        assert not path.exists()

    with tempfile.TemporaryDirectory(prefix="kgrpc-") as directory:
        asyncio.run(main(Path(directory) / "dra.sock"))


@pytest.mark.parametrize("replacement", ["socket", "file"])
def test_stop_leaves_alone_what_has_replaced_its_socket(replacement: str) -> None:
    async def main(path: Path) -> None:
        server = _server()
        await server.start(path)
        path.unlink()
        newer = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        try:
            if replacement == "socket":
                newer.bind(str(path))  # another instance's socket at the same path
            else:
                path.write_text("not ours")
            inode = path.lstat().st_ino
            await server.stop(None)
            assert path.exists(), f"stop() removed the {replacement} that had replaced its socket"
            assert path.lstat().st_ino == inode
        finally:
            newer.close()

    with tempfile.TemporaryDirectory(prefix="kgrpc-") as directory:
        asyncio.run(main(Path(directory) / "dra.sock"))
