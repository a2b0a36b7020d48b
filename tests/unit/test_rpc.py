"""The plugin's own gRPC server (dra_driver/rpc) against grpcio's client, and raw bytes.

The kubelet's client (grpc-go) is exercised by benchmarks/prepare.py (kubelet-client)
and by the node tier's real kubelets; here grpcio's C-core client checks the same
protocol, and the error paths a well-behaved client never takes are driven by hand.
"""

from __future__ import annotations

import asyncio
import socket as socketlib
import tempfile
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import grpc
import hpack
import pytest

from dra_driver.kubeletapi.dra.v1 import api_pb2 as dra_v1
from dra_driver.kubeletapi.dra.v1 import api_pb2_grpc as dra_v1_grpc
from dra_driver.kubeletapi.drahealth.v1 import api_pb2 as health_v1
from dra_driver.kubeletapi.drahealth.v1 import api_pb2_grpc as health_v1_grpc
from dra_driver.rpc import frames
from dra_driver.rpc.server import RpcError, RpcServer, Status, service_methods

PREPARE = f"/{dra_v1.DESCRIPTOR.services_by_name['DRAPlugin'].full_name}/NodePrepareResources"


class _Plugin:
    """Answers by the first claim's name: ok, boom (raises), refused (RpcError), brief (0.3 s),
    slow (30 s), big."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def NodePrepareResources(self, request: Any) -> Any:
        name = request.claims[0].name if request.claims else "ok"
        if name == "boom":
            raise ValueError("the handler broke")
        if name == "refused":
            raise RpcError(Status.INVALID_ARGUMENT, "claim names must be lower case: ünicode")
        if name == "brief":
            await asyncio.sleep(0.3)
        if name == "slow":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        size = 1 << 20 if name == "big" else 0
        error = "x" * size
        return dra_v1.NodePrepareResourcesResponse(
            claims={c.uid: dra_v1.NodePrepareResourceResponse(error=error) for c in request.claims}
        )

    async def NodeUnprepareResources(self, request: Any) -> Any:
        return dra_v1.NodeUnprepareResourcesResponse(
            claims={c.uid: dra_v1.NodeUnprepareResourceResponse() for c in request.claims}
        )


class _Health:
    def __init__(self) -> None:
        self.ended = asyncio.Event()

    async def NodeWatchResources(self, request: Any) -> AsyncIterator[Any]:
        try:
            for i in range(3):
                yield health_v1.NodeWatchResourcesResponse(
                    devices=[
                        health_v1.DeviceHealth(device=health_v1.DeviceIdentifier(device_name=f"gpu-{i}"))
                    ]
                )
            await asyncio.Event().wait()
        finally:
            self.ended.set()


@pytest.fixture
def socket_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="rpc-") as directory:  # tmp_path can exceed 107 bytes
        yield Path(directory) / "dra.sock"


def _server(plugin: _Plugin, health: _Health) -> RpcServer:
    methods = [
        *service_methods(dra_v1.DESCRIPTOR.services_by_name["DRAPlugin"], plugin),
        *service_methods(health_v1.DESCRIPTOR.services_by_name["DRAResourceHealth"], health),
    ]
    return RpcServer(methods, "test")


def _claim(name: str, uid: str = "uid-1") -> Any:
    return dra_v1.NodePrepareResourcesRequest(claims=[dra_v1.Claim(namespace="ns", name=name, uid=uid)])


async def _rpc_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    """The error `call` ends with; the test fails if it succeeds."""
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call
    return failed.value


def run(socket_path: Path, body: Any) -> None:
    """Start a server on `socket_path`, run `body(channel, plugin, health, server)`, stop."""

    async def main() -> None:
        plugin, health = _Plugin(), _Health()
        server = _server(plugin, health)
        await server.start(socket_path)
        try:
            async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
                await body(channel, plugin, health, server)
        finally:
            await server.stop(1)

    asyncio.run(main())


def test_unary_calls_and_many_at_once(socket_path: Path) -> None:
    async def body(channel: grpc.aio.Channel, plugin: _Plugin, health: _Health, server: RpcServer) -> None:
        stub = dra_v1_grpc.DRAPluginStub(channel)
        answer = await stub.NodePrepareResources(_claim("ok"), timeout=10)
        assert list(answer.claims) == ["uid-1"] and answer.claims["uid-1"].error == ""
        answers = await asyncio.gather(
            *(stub.NodePrepareResources(_claim("ok", f"uid-{i}"), timeout=10) for i in range(200))
        )
        assert [list(a.claims) for a in answers] == [[f"uid-{i}"] for i in range(200)]
        unprepared = await stub.NodeUnprepareResources(
            dra_v1.NodeUnprepareResourcesRequest(claims=[dra_v1.Claim(uid="u")]), timeout=10
        )
        assert list(unprepared.claims) == ["u"]

    run(socket_path, body)


def test_an_answer_larger_than_the_flow_control_windows_arrives_whole(socket_path: Path) -> None:
    async def body(channel: grpc.aio.Channel, plugin: _Plugin, health: _Health, server: RpcServer) -> None:
        stub = dra_v1_grpc.DRAPluginStub(channel)
        answers = await asyncio.gather(
            *(stub.NodePrepareResources(_claim("big", f"u{i}"), timeout=20) for i in range(3))
        )
        assert [len(a.claims[f"u{i}"].error) for i, a in enumerate(answers)] == [1 << 20] * 3

    run(socket_path, body)


def test_errors_say_what_happened_and_the_server_keeps_serving(socket_path: Path) -> None:
    async def body(channel: grpc.aio.Channel, plugin: _Plugin, health: _Health, server: RpcServer) -> None:
        stub = dra_v1_grpc.DRAPluginStub(channel)
        broke = await _rpc_error(stub.NodePrepareResources(_claim("boom"), timeout=10))
        assert broke.code() == grpc.StatusCode.UNKNOWN
        assert broke.details() == "ValueError: the handler broke"
        refused = await _rpc_error(stub.NodePrepareResources(_claim("refused"), timeout=10))
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.details() == "claim names must be lower case: ünicode"

        unknown = channel.unary_unary("/v1.DRAPlugin/NodeExplode")
        missing = await _rpc_error(unknown(b"", timeout=10))
        assert missing.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "/v1.DRAPlugin/NodeExplode" in (missing.details() or "")

        garbage = channel.unary_unary(PREPARE)
        malformed = await _rpc_error(garbage(b"\xff\xff\xff", timeout=10))
        assert malformed.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert malformed.details() == (
            "cannot parse the request as a k8s.io.kubelet.pkg.apis.dra.v1.NodePrepareResourcesRequest"
        )

        huge = await _rpc_error(garbage(b"\x0a" + b"\x00" * (5 << 20), timeout=20))
        assert huge.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        answer = await stub.NodePrepareResources(_claim("ok"), timeout=10)
        assert list(answer.claims) == ["uid-1"]

    run(socket_path, body)


def test_the_callers_deadline_cancels_the_handler(socket_path: Path) -> None:
    async def body(channel: grpc.aio.Channel, plugin: _Plugin, health: _Health, server: RpcServer) -> None:
        stub = dra_v1_grpc.DRAPluginStub(channel)
        late = await _rpc_error(stub.NodePrepareResources(_claim("slow"), timeout=0.3))
        assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(plugin.cancelled.wait(), 5)
        assert (await stub.NodePrepareResources(_claim("ok"), timeout=10)).claims

    run(socket_path, body)


def test_a_stream_delivers_messages_and_ends_when_the_caller_cancels(socket_path: Path) -> None:
    async def body(channel: grpc.aio.Channel, plugin: _Plugin, health: _Health, server: RpcServer) -> None:
        call = health_v1_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
            health_v1.NodeWatchResourcesRequest()
        )
        seen = [(await call.read()).devices[0].device.device_name for _ in range(3)]
        assert seen == ["gpu-0", "gpu-1", "gpu-2"]
        call.cancel()
        await asyncio.wait_for(health.ended.wait(), 5)

    run(socket_path, body)


def test_stop_ends_streams_as_unavailable_and_lets_unary_calls_finish(socket_path: Path) -> None:
    async def main() -> None:
        plugin, health = _Plugin(), _Health()
        server = _server(plugin, health)
        await server.start(socket_path)
        async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
            call = health_v1_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                health_v1.NodeWatchResourcesRequest()
            )
            for _ in range(3):
                await call.read()
            stub = dra_v1_grpc.DRAPluginStub(channel)
            in_flight = asyncio.ensure_future(stub.NodePrepareResources(_claim("brief"), timeout=10))
            await asyncio.sleep(0.1)
            await server.stop(grace=5)
            assert list((await in_flight).claims) == ["uid-1"]  # finished within the grace
            ended = await _rpc_error(call.read())
            assert ended.code() == grpc.StatusCode.UNAVAILABLE
            assert health.ended.is_set()
            # the connection is gone too
            closed = await _rpc_error(stub.NodePrepareResources(_claim("ok"), timeout=5))
            assert closed.code() == grpc.StatusCode.UNAVAILABLE
        assert not socket_path.exists()  # the kubelet's watcher deregisters a plugin whose socket goes

    asyncio.run(main())


def test_stop_leaves_a_socket_that_another_instance_bound_at_the_same_path(socket_path: Path) -> None:
    async def main() -> None:
        old = _server(_Plugin(), _Health())
        await old.start(socket_path)
        socket_path.unlink()  # what the next instance's start does with a stale socket
        new = _server(_Plugin(), _Health())
        await new.start(socket_path)
        await old.stop(1)
        assert socket_path.exists()
        async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
            assert (
                await dra_v1_grpc.DRAPluginStub(channel).NodePrepareResources(_claim("ok"), timeout=10)
            ).claims
        await new.stop(1)
        assert not socket_path.exists()

    asyncio.run(main())


def test_a_request_sent_while_the_server_starts_going_away_is_still_answered(socket_path: Path) -> None:
    """First GOAWAY allows every stream and comes with a PING; a request the peer sent before
    answering that PING is served, and only then the final GOAWAY names it as the last."""

    async def main() -> None:
        server = _server(_Plugin(), _Health())
        await server.start(socket_path)
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        writer.write(frames.PREFACE + frames.settings({}))
        stopping = asyncio.create_task(server.stop(grace=5))
        seen: list[tuple[int, int, int, bytes]] = []
        buffer = b""

        async def until(kind: int) -> tuple[int, int, int, bytes]:
            nonlocal buffer
            while True:
                for f in _frames(buffer)[len(seen) :]:
                    seen.append(f)
                    if f[0] == kind:
                        return f
                buffer += await asyncio.wait_for(reader.read(65536), 5)

        first = await until(frames.FrameType.GOAWAY)
        assert int.from_bytes(first[3][:4], "big") == frames.MAX_STREAM
        ping = await until(frames.FrameType.PING)
        block = hpack.Encoder().encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", PREPARE),
                ("content-type", "application/grpc"),
            ]
        )
        message = _claim("ok").SerializeToString()
        writer.write(
            frames.frame(frames.FrameType.HEADERS, frames.Flag.END_HEADERS, 1, block)
            + frames.frame(
                frames.FrameType.DATA,
                frames.Flag.END_STREAM,
                1,
                b"\x00" + len(message).to_bytes(4, "big") + message,
            )
            + frames.frame(frames.FrameType.PING, frames.Flag.ACK, 0, ping[3])
        )
        final = await until(frames.FrameType.GOAWAY)
        assert int.from_bytes(final[3][:4], "big") == 1
        while not any(k == frames.FrameType.HEADERS and f & frames.Flag.END_STREAM for k, f, _, _ in seen):
            await until(frames.FrameType.HEADERS)
        answer = b"".join(p for k, _, stream, p in seen if k == frames.FrameType.DATA and stream == 1)
        assert dra_v1.NodePrepareResourcesResponse.FromString(answer[5:]).claims["uid-1"].error == ""
        writer.close()
        await stopping

    asyncio.run(main())


def _raw_exchange(path: Path, data: bytes, headers_of: int | None = None) -> bytes:
    """Send `data` on a new connection; what comes back until the server closes it, or with
    `headers_of`, the payload of the first HEADERS frame on that stream."""
    with socketlib.socket(socketlib.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(path))
        s.sendall(data)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
            if headers_of is None:
                continue
            for kind, _, stream, payload in _frames(received):
                if kind == frames.FrameType.HEADERS and stream == headers_of:
                    return payload
        return received


def _frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, pos = [], 0
    while pos + 9 <= len(data):
        length = int.from_bytes(data[pos : pos + 3], "big")
        out.append(
            (
                data[pos + 3],
                data[pos + 4],
                int.from_bytes(data[pos + 5 : pos + 9], "big"),
                data[pos + 9 : pos + 9 + length],
            )
        )
        pos += 9 + length
    return out


@pytest.mark.parametrize(
    ("sent", "code", "says"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", frames.ErrorCode.PROTOCOL_ERROR, "preface"),
        (
            frames.PREFACE + frames.frame(frames.FrameType.PING, 0, 0, b"1234"),
            frames.ErrorCode.PROTOCOL_ERROR,
            "PING",
        ),
        (
            frames.PREFACE + frames.frame(frames.FrameType.HEADERS, 5, 1, b"\xff\xff\xff\xff"),
            frames.ErrorCode.COMPRESSION_ERROR,
            "",
        ),
        (
            frames.PREFACE + frames.frame(frames.FrameType.HEADERS, 5, 2, b"\x82"),
            frames.ErrorCode.PROTOCOL_ERROR,
            "stream 2",
        ),
        (
            frames.PREFACE + frames.frame(frames.FrameType.DATA, 0, 7, b"x"),
            frames.ErrorCode.PROTOCOL_ERROR,
            "idle stream 7",
        ),
        (
            frames.PREFACE + b"\x01\x00\x00" + b"\x00\x00\x00\x00\x00\x00",
            frames.ErrorCode.FRAME_SIZE_ERROR,
            "65536",
        ),
    ],
    ids=["http1", "short-ping", "bad-hpack", "even-stream", "data-on-idle", "oversized-frame"],
)
def test_a_peer_that_breaks_http2_gets_a_goaway_that_says_why_and_others_are_unaffected(
    socket_path: Path, sent: bytes, code: frames.ErrorCode, says: str
) -> None:
    async def body(channel: grpc.aio.Channel, plugin: _Plugin, health: _Health, server: RpcServer) -> None:
        received = await asyncio.to_thread(_raw_exchange, socket_path, sent)
        goaways = [payload for kind, _, _, payload in _frames(received) if kind == frames.FrameType.GOAWAY]
        assert len(goaways) == 1, _frames(received)
        assert int.from_bytes(goaways[0][4:8], "big") == code
        assert says in goaways[0][8:].decode()
        assert (
            await dra_v1_grpc.DRAPluginStub(channel).NodePrepareResources(_claim("ok"), timeout=10)
        ).claims

    run(socket_path, body)


def test_a_request_that_is_not_grpc_gets_http_415(socket_path: Path) -> None:
    async def body(channel: grpc.aio.Channel, plugin: _Plugin, health: _Health, server: RpcServer) -> None:
        block = hpack.Encoder().encode(
            [(":method", "POST"), (":scheme", "http"), (":path", PREPARE), ("content-type", "text/plain")]
        )
        sent = frames.PREFACE + frames.settings({}) + frames.frame(frames.FrameType.HEADERS, 5, 1, block)
        sent += frames.goaway(0, frames.ErrorCode.NO_ERROR)
        received = await asyncio.to_thread(_raw_exchange, socket_path, sent, 1)
        headers = hpack.Decoder().decode(received)
        assert (":status", "415") in headers

    run(socket_path, body)


@pytest.mark.parametrize("value", [0, 14, 15, 127, 128, 300, 16_384, 2**21])
@pytest.mark.parametrize("prefix", [4, 7])
def test_hpack_integers_decode_as_written(value: int, prefix: int) -> None:
    name = b"x-" + b"n" * (value % 50)
    field = frames.hpack_literal(name, b"v" * min(value, 5000))
    assert hpack.Decoder(max_header_list_size=1 << 22).decode(field, raw=True) == [
        (name, b"v" * min(value, 5000))
    ]
    encoded = frames.hpack_int(value, prefix, 0)
    assert encoded[0] & ((1 << prefix) - 1) == min(value, (1 << prefix) - 1)
