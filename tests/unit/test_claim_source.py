"""Reading claims for Prepare: each failure becomes that claim's own answer, and is counted."""

from __future__ import annotations

import asyncio
import time

from dra_driver import kube, metrics
from dra_driver.kube.credentials import Credentials, static
from dra_driver.plugin.claim_source import ClaimReader
from dra_driver.plugin.claims import ClaimGone, ClaimRef, ClaimRejected
from tests.harness.objects import wait_for_async


def _errors(code: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "gpu_dra_api_errors_total", {"component": "claims", "code": code}
    )
    return value or 0.0


def test_a_missing_claim_and_an_unreachable_server_are_answers_and_metrics() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b'{"kind":"Status","code":404}'
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    async def run() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reachable = kube.ApiClient(Credentials(f"http://127.0.0.1:{port}", False, static(None)))
        server_gone = await asyncio.start_server(serve, "127.0.0.1", 0)
        dead_port = server_gone.sockets[0].getsockname()[1]
        server_gone.close()
        await server_gone.wait_closed()
        unreachable = kube.ApiClient(
            Credentials(f"http://127.0.0.1:{dead_port}", False, static(None))
        )
        ref = ClaimRef("ns", "gone", "uid-gone")
        before_404, before_network = _errors("404"), _errors("network")
        try:
            missing = (await ClaimReader(reachable, timeout=5).read([ref]))[ref.uid]
            down = (await ClaimReader(unreachable, timeout=5).read([ref]))[ref.uid]
        finally:
            await reachable.close()
            await unreachable.close()
            server.close()
        assert isinstance(missing, ClaimRejected) and "does not exist" in str(missing)
        assert isinstance(
            down, ClaimRejected
        ) and "reading ResourceClaim ns/gone from the API server failed" in str(down)
        assert _errors("404") == before_404 + 1
        assert _errors("network") == before_network + 1

    asyncio.run(run())


def test_a_call_naming_1024_missing_claims_is_bounded_and_leaves_room_for_another_call() -> None:
    """The outside run: 1,024 claims that do not exist were 1,024 GETs while other calls
    timed out. Here an API server answers each GET after 20 ms, over the daemon's 8
    connections: that call makes a few dozen GETs, every claim gets an answer, and a
    one-claim call started meanwhile is read as if the API server were idle."""
    gets: list[str] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                name = head.split(b" ", 2)[1].rsplit(b"/", 1)[-1].decode()
                gets.append(name)
                await asyncio.sleep(0.02)
                if name == "real":
                    body = b'{"kind":"ResourceClaim","metadata":{"name":"real","namespace":"ns","uid":"u"}}'
                    status = b"200 OK"
                else:
                    body, status = b'{"kind":"Status","code":404}', b"404 Not Found"
                writer.write(b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def run() -> tuple[dict[str, object], float, float, object]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        api = kube.ApiClient(Credentials(f"http://127.0.0.1:{port}", False, static(None)), connections=8)
        reader = ClaimReader(api, timeout=30)
        refs = [ClaimRef("ns", f"gone-{i}", f"uid-{i}") for i in range(1024)]
        try:
            started = time.monotonic()
            many = asyncio.create_task(reader.read(refs))
            await wait_for_async("the big read on all 8 connections", lambda: len(gets) >= 8)
            one_started = time.monotonic()
            one = (await reader.read([ClaimRef("ns", "real", "u")]))["u"]
            one_took = time.monotonic() - one_started
            answers = await many
            return dict(answers), time.monotonic() - started, one_took, one
        finally:
            await api.close()
            server.close()

    answers, took, one_took, one = asyncio.run(run())
    missing = len([g for g in gets if g != "real"])
    assert missing <= 32, f"{missing} GETs for a call naming 1,024 claims that do not exist ({took:.1f} s)"
    assert len(answers) == 1024 and all(isinstance(a, ClaimRejected) for a in answers.values())
    unread = [str(a) for a in answers.values() if not isinstance(a, ClaimGone)]
    assert unread and all("claims of this call do not exist" in a for a in unread), unread[:2]
    assert took < 5, f"the call took {took:.1f} s"
    assert isinstance(one, dict) and one["metadata"]["name"] == "real"
    assert one_took < 0.5, f"a one-claim call waited {one_took:.2f} s behind the 1,024-claim call"
