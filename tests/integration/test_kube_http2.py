"""dra_driver.kube over HTTP/2 against a real kube-apiserver: its TLS offers "h2"; near (on
loopback) the client keeps to HTTP/1.1 unless asked, and asked, its requests go as streams of
one connection, request and answer bodies past both
sides' flow-control windows included, a watch beside other requests on it; and, with the
API server 200 ms away each way (tests/harness/delay_proxy.py), sixteen claim reads at once
(a Prepare burst, with the plugin's own connection bound) go out together on one connection
and take about one round trip, where HTTP/1.1 connections made the last eight wait for the
first eight. The error cases a real server will not produce on demand (GOAWAY, resets, a
connection dropped mid-body) are tests/unit/test_kube_http2_errors.py.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterator

import pytest
from kubernetes import client

from dra_driver import kube
from dra_driver.kube import transport
from dra_driver.kube.credentials import Credentials, static
from dra_driver.node.daemon import API_CONNECTIONS
from tests.harness.claims import allocated_claim
from tests.harness.cluster import ADMIN_TOKEN, ControlPlane
from tests.harness.delay_proxy import DelayProxy

DELAY = 0.2  # seconds each way: a far API server
BURST = 16


def _client(
    cp: ControlPlane, port: int, connections: int = kube.CONNECTIONS, http2: bool | None = None
) -> kube.ApiClient:
    context = ssl.create_default_context(cafile=str(cp.ca_file))
    credentials = Credentials(f"https://127.0.0.1:{port}", context, static(f"Bearer {ADMIN_TOKEN}"))
    if http2 is None:  # the default, as the plugin has it (and as a client before HTTP/2 was made)
        return kube.ApiClient(credentials, connections)
    return kube.ApiClient(credentials, connections, http2)


@pytest.fixture
def far(control_plane: ControlPlane) -> Iterator[DelayProxy]:
    proxy = DelayProxy(("127.0.0.1", control_plane.api_port), DELAY).start()
    yield proxy
    proxy.stop()


def test_kube_apiserver_is_spoken_to_in_http2_with_bodies_past_the_windows_and_a_watch_beside(
    control_plane: ControlPlane, namespace: str
) -> None:
    # Past the server's per-stream upload window and our STREAM_WINDOW: both sides' WINDOW_UPDATEs.
    value = "x" * (900 * 2**10)
    path = f"/api/v1/namespaces/{namespace}/configmaps"

    async def run() -> None:
        api = _client(control_plane, control_plane.api_port, http2=True)  # near: only when asked
        try:
            listed = await kube.request(api, "GET", path)
            assert api._pool.protocol == "h2"
            events = kube.watch(api, path, listed["metadata"]["resourceVersion"], timeout_seconds=30)
            first = asyncio.ensure_future(anext(events))
            made = await kube.request(api, "POST", path, {"metadata": {"name": "big"}, "data": {"v": value}})
            got = await kube.request(api, "GET", f"{path}/big")
            assert got["data"]["v"] == value and got["metadata"]["uid"] == made["metadata"]["uid"]
            kind, obj = await asyncio.wait_for(first, 30)
            assert (kind, obj["metadata"]["name"], len(obj["data"]["v"])) == ("ADDED", "big", len(value))
            await events.aclose()
            # Many at once, more than MAX_STREAMS: the rest wait for a stream, none fails.
            many = await asyncio.gather(*(kube.request(api, "GET", f"{path}/big") for _ in range(80)))
            assert {m["metadata"]["uid"] for m in many} == {made["metadata"]["uid"]}
        finally:
            await api.close()

    asyncio.run(run())


def test_sixteen_claim_reads_from_a_far_api_server_take_one_round_trip_on_one_connection(
    control_plane: ControlPlane, api: client.ApiClient, namespace: str, far: DelayProxy
) -> None:
    for i in range(BURST):
        allocated_claim(api, namespace, f"c{i}", [{"pool": "n", "device": f"gpu-{i}"}], "gpu")
    claims = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"

    async def run() -> tuple[float, float]:
        client_ = _client(control_plane, far.port, connections=API_CONNECTIONS)  # as the plugin's
        try:
            await kube.request(client_, "GET", f"{claims}/c0")  # connected, as a running plugin is
            t0 = time.monotonic()
            await kube.request(client_, "GET", f"{claims}/c1")
            one = time.monotonic() - t0
            t0 = time.monotonic()
            reads = (kube.request(client_, "GET", f"{claims}/c{i}") for i in range(BURST))
            got = await asyncio.gather(*reads)
            burst = time.monotonic() - t0
            assert [g["metadata"]["name"] for g in got] == [f"c{i}" for i in range(BURST)]
            return one, burst
        finally:
            await client_.close()

    one, burst = asyncio.run(run())
    assert one >= 2 * DELAY, f"one GET took {one:.3f} s: the proxy did not delay it"
    assert far.connections == 1, f"{far.connections} TCP connections for {BURST} reads: not multiplexed"
    assert burst < 1.6 * one, f"{BURST} reads at once took {burst:.3f} s, one took {one:.3f} s"


def test_kube_apiserver_near_is_spoken_to_in_http_1_1(
    control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On loopback the first connection takes a few ms (the bound made long here, so that a
    loaded machine's slow handshake does not count as far): HTTP/1.1, whose requests cost
    less CPU."""
    monkeypatch.setattr(transport, "FAR_HANDSHAKE_SECONDS", 0.2)

    async def run() -> str:
        api = _client(control_plane, control_plane.api_port)
        try:
            await kube.request(api, "GET", "/version")
            return api._pool.protocol
        finally:
            await api.close()

    assert asyncio.run(run()) == "http/1.1"
