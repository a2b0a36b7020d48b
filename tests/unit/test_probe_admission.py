"""The metrics port under a flood: the kubelet's probes are never refused, /metrics is
rendered at most once per interval, and claim identities are not served by default.

Each test serves a real ProbeServer (h11, on a thread of its own) on 127.0.0.1 in this
process and floods it from an aiohttp client in the same event loop; a "kubelet" sends its
probes one after the other on a connection of its own beside the flood and counts what is
not 200.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

import aiohttp
from prometheus_client import Metric
from prometheus_client.registry import Collector

from dra_driver import metrics
from dra_driver.probes import CheckResult, ProbeServer, plugin_probes


async def _slow_check() -> CheckResult:
    await asyncio.sleep(0.2)
    return CheckResult("slow", True)


async def _flood(url: str, done: asyncio.Event, concurrency: int) -> dict[int, int]:
    answers: dict[int, int] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def one_client() -> None:
            while not done.is_set():
                async with session.get(url) as response:
                    await response.read()
                    answers[response.status] = answers.get(response.status, 0) + 1

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return answers


async def _kubelet(url: str, probes: int, done: asyncio.Event) -> list[int]:
    statuses = []
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.sleep(0.2)  # the flood under way
            for _ in range(probes):
                async with session.get(url) as response:
                    await response.read()
                    statuses.append(response.status)
                await asyncio.sleep(0.05)  # the kubelet probes every few seconds; here more often
    finally:
        done.set()
    return statuses


def test_a_flood_of_probes_and_scrapes_never_gets_the_kubelets_probe_refused() -> None:
    async def run() -> tuple[list[int], dict[int, int], dict[int, int]]:
        server = ProbeServer(metrics.SERVED, liveness=[_slow_check], interval=0.05, max_in_flight=8)
        port = await server.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session, session.get(f"{base}/livez") as first:
                assert first.status == 200  # the first run of the checks has ended
            done = asyncio.Event()
            kubelet, probes, scrapes = await asyncio.gather(
                _kubelet(f"{base}/livez", 20, done),
                _flood(f"{base}/livez", done, 64),
                _flood(f"{base}/metrics", done, 16),
            )
            return kubelet, probes, scrapes
        finally:
            await server.stop()

    kubelet, probes, scrapes = asyncio.run(run())
    refused = [s for s in kubelet if s != 200]
    assert not refused, (f"{len(refused)} of the kubelet's {len(kubelet)} probes were not 200 "
                         f"(flood of /livez: {probes}, of /metrics: {scrapes})")
    assert probes.get(200, 0) > 0 and scrapes.get(200, 0) > 0


class _Counting(Collector):
    def __init__(self) -> None:
        self.collected = 0

    def collect(self) -> Iterable[Metric]:
        self.collected += 1
        return metrics.SERVED.collect()


def test_metrics_are_rendered_at_most_once_per_interval() -> None:
    counting = _Counting()

    async def run() -> list[int]:
        server = ProbeServer(counting)
        server.metrics_interval = 3600.0
        port = await server.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:

                async def scrape() -> int:
                    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                        await response.read()
                        return response.status

                return [await scrape() for _ in range(50)]
        finally:
            await server.stop()

    statuses = asyncio.run(run())
    assert statuses == [200] * 50
    assert counting.collected == 1, f"/metrics rendered {counting.collected} times for 50 scrapes"


def test_claim_identities_are_served_only_when_turned_on(tmp_path: Path) -> None:
    labels = ("gpu-0", "GPU-1", "0000:01:00.0", "team-a", "train", "uid-1", "team-a", "trainer-0")
    metrics.device_claim_info.labels(*labels).set(1)

    async def scrape(server: ProbeServer) -> str:
        server.metrics_interval = 0.0
        port = await server.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session, \
                    session.get(f"http://127.0.0.1:{port}/metrics") as response:
                return await response.text()
        finally:
            await server.stop()

    try:
        served = asyncio.run(scrape(plugin_probes(tmp_path / "dra.sock", tmp_path / "reg.sock", None)))
        assert "gpu_dra_device_claim_info" not in served
        assert "gpu_dra_build_info" in served
        metrics.serve_claim_identity(True)
        served = asyncio.run(scrape(plugin_probes(tmp_path / "dra.sock", tmp_path / "reg.sock", None)))
        assert 'claim_uid="uid-1"' in served
    finally:
        metrics.serve_claim_identity(False)
        metrics.device_claim_info.remove(*labels)
