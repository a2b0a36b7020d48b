"""A child process for tests/unit/test_kube_bounds.py: a fake API server (aiohttp) and
`dra_driver.kube` against it, in one event loop, with the peak RSS the client's work adds.

`python -m tests.unit.kube_bounds_child SCENARIO` prints one JSON line: the error the
client raised (or what it returned), how many requests the server saw, and `grew_mib`, the
growth of this process's peak RSS (ru_maxrss) over the work. The fake server writes its
answers a chunk at a time from one small buffer, so that what grows is what the client holds.
Scenarios:
* huge: a GET answered with a 1 GiB body (chunked, no Content-Length);
* list: 500 ResourceClaims of 300 KiB each (150 MiB), pages honoured (`limit`, `continue`),
  two of them allocated on this node; read by ClaimReader.allocated_here;
* error500: a GET answered 500 with a 256 MiB body;
* watchline: a watch whose first event is a 256 MiB line.
This file must not assert: the test reads its line.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
from typing import Any

from aiohttp import web

from dra_driver import kube
from dra_driver.kube import ApiClient
from dra_driver.kube.credentials import Credentials
from dra_driver.plugin.claim_source import ClaimReader

MiB = 2**20
CHUNK = b"x" * MiB
CLAIMS = 500
CLAIM_PADDING = 300 * 1024
DRIVER, POOL = "gpu.dra-driver.dev", "node-a"
HERE = {7, 480}  # the claims allocated on this node


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _stream(
    request: web.Request, status: int, head: bytes, size: int, tail: bytes
) -> web.StreamResponse:
    response = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    try:
        await response.write(head)
        left = size
        while left > 0:
            piece = CHUNK[: min(left, len(CHUNK))]
            await response.write(piece)
            left -= len(piece)
        await response.write(tail)
        await response.write_eof()
    except (ConnectionError, RuntimeError):
        pass  # the client went away: what a bounded client does
    return response


def _claim(i: int) -> bytes:
    results = [{"driver": DRIVER, "pool": POOL if i in HERE else "elsewhere", "device": "gpu-0"}]
    claim: dict[str, Any] = {
        "metadata": {"name": f"claim-{i}", "namespace": "default", "uid": f"uid-{i}",
                     "annotations": {"padding": "p" * CLAIM_PADDING}},
        "status": {"allocation": {"devices": {"results": results}}},
    }
    return json.dumps(claim).encode()


async def main(scenario: str) -> dict[str, Any]:
    seen: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append(request.path_qs)
        if scenario == "huge":
            return await _stream(request, 200, b'{"padding": "', 1024 * MiB, b'"}')
        if scenario == "error500":
            return await _stream(request, 500, b'{"kind": "Status", "message": "', 256 * MiB, b'"}')
        if scenario == "watchline":
            return await _stream(request, 200, b'{"type": "ADDED", "object": {"p": "', 256 * MiB, b'"}}\n')
        limit = int(request.query.get("limit") or CLAIMS)
        start = int(request.query.get("continue") or 0)
        end = min(start + limit, CLAIMS)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        meta = {"resourceVersion": "42", **({"continue": str(end)} if end < CLAIMS else {})}
        try:
            await response.write(b'{"kind": "ResourceClaimList", "metadata": ' + json.dumps(meta).encode()
                                 + b', "items": [')
            for i in range(start, end):
                await response.write((b", " if i > start else b"") + _claim(i))
            await response.write(b"]}")
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]

    async def anonymous() -> str | None:
        return None

    api = ApiClient(Credentials(f"http://127.0.0.1:{port}", False, anonymous))
    _claim(0)  # warm: the first claim's bytes built once before the baseline
    before = _peak_mib()
    outcome: dict[str, Any] = {}
    try:
        if scenario == "list":
            found = await ClaimReader(api, timeout=60).allocated_here(DRIVER, POOL)
            outcome["kept"] = None if found is None else sorted(c["metadata"]["name"] for c in found)
        elif scenario == "watchline":
            async for kind, _ in kube.watch(api, "/apis/resource.k8s.io/v1/resourceslices", "1",
                                            timeout_seconds=60):
                outcome["event"] = kind
                break
        else:
            got = await kube.request(api, "GET", "/apis/resource.k8s.io/v1/namespaces/d/resourceclaims/c",
                                     timeout=60)
            outcome["keys"] = sorted(got)
    except Exception as e:  # the test reads what was raised
        outcome["error"] = f"{type(e).__name__}: {e}"[:500]
    outcome["grew_mib"] = round(_peak_mib() - before, 1)
    outcome["requests"] = len(seen)
    outcome["queries"] = seen[:20]
    await api.close()
    await runner.cleanup()
    return outcome


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
