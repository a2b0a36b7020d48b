"""Reading claims for Prepare: each failure becomes that claim's own answer, and is counted."""

from __future__ import annotations

import asyncio

from dra_driver import kube, metrics
from dra_driver.kube.credentials import Credentials, static
from dra_driver.plugin.claim_source import ClaimReader
from dra_driver.plugin.claims import ClaimRef, ClaimRejected


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
