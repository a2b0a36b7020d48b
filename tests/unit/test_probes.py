"""The metrics port (dra_driver.probes) and the metric helpers (dra_driver.metrics).

Real sockets throughout: the probe server on a TCP port of loopback, the plugin's gRPC
services on unix sockets; a check that cannot reach them must fail, one that can must pass.
The port's HTTP is checked with raw bytes: oversized heads and bodies, garbage, methods,
HEAD, keep-alive, a silent or trickling client, and stop() with connections open.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dra_driver import metrics
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.registration import RegistrationService, add_registration
from dra_driver.plugin.server import SocketServer
from dra_driver.plugin.service import add_dra_services
from dra_driver.plugin.state import ClaimResult
from dra_driver.probes import CheckResult, Heartbeat, ProbeServer, plugin_probes
from tests.harness.objects import wait_for_async


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()


async def _fetch(port: int, path: str) -> tuple[int, str]:
    return await asyncio.to_thread(_get, port, path)


def _sample(name: str, **labels: str) -> float:
    value = metrics.REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def _ok() -> CheckResult:
    return CheckResult("always", True)


async def _bad() -> CheckResult:
    return CheckResult("never", False, "broken on purpose")


def test_metrics_and_probe_paths() -> None:
    async def main() -> None:
        server = ProbeServer(metrics.REGISTRY, liveness=[_ok], readiness=[_bad])
        port = await server.start("127.0.0.1", 0)
        try:
            status, body = await _fetch(port, "/metrics")
            assert status == 200
            assert "gpu_dra_build_info{" in body
            assert "gpu_dra_request_duration_seconds" in body
            assert "process_resident_memory_bytes" in body
            assert (await _fetch(port, "/livez"))[0] == 200
            status, body = await _fetch(port, "/readyz")
            assert status == 503
            assert "[-]never broken on purpose" in body
            assert (await _fetch(port, "/nothing"))[0] == 404
        finally:
            await server.stop()

    asyncio.run(main())


def test_heartbeat_stuck_and_ended() -> None:
    async def main() -> None:
        beat = Heartbeat("loop", stuck_after=0.05)
        assert (await beat.check()).ok
        beat.busy()
        assert (await beat.check()).ok
        assert beat.busy_since is not None
        beat.busy_since -= 0.1  # busy for twice stuck_after (the monotonic clock, not a sleep)
        result = await beat.check()
        assert not result.ok and "running for" in result.detail
        beat.idle()
        assert (await beat.check()).ok

        async def fail() -> None:
            raise RuntimeError("lost the API server")

        task = asyncio.create_task(fail())
        task.add_done_callback(beat.task_ended)
        with contextlib.suppress(RuntimeError):
            await task
        await wait_for_async("the done callback", lambda: beat.ended_with)
        result = await beat.check()
        assert not result.ok and "lost the API server" in result.detail

    asyncio.run(main())


class _Preparer:
    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        return {r.uid: ClaimResult(error="refused" if r.name == "bad" else None) for r in refs}

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        return {r.uid: ClaimResult() for r in refs}


class _Board:
    async def follow(self):  # type: ignore[no-untyped-def]
        await asyncio.Event().wait()
        yield ()


def test_plugin_probes_follow_the_sockets(tmp_path: Path) -> None:
    """Live and ready while both servers answer; not live once the DRA socket is gone;
    a claimless probe call never shows in the request metrics."""

    async def main() -> None:
        dra_socket, reg_socket = tmp_path / "dra.sock", tmp_path / "reg.sock"
        dra = SocketServer("dra", lambda s: add_dra_services(s, _Preparer(), _Board()))  # type: ignore[arg-type]
        registration = RegistrationService("gpu.example.com", str(dra_socket))
        reg = SocketServer("reg", lambda s: add_registration(s, registration))
        await dra.start(dra_socket)
        await reg.start(reg_socket)
        beat = Heartbeat("slice-publisher", stuck_after=60)
        server = plugin_probes(dra_socket, reg_socket, beat)
        port = await server.start("127.0.0.1", 0)
        before = _sample("gpu_dra_request_duration_seconds_count", operation="prepare", result="success")
        try:
            assert (await _fetch(port, "/livez"))[0] == 200
            status, body = await _fetch(port, "/readyz")
            assert status == 200, body
            assert "[+]registration-socket" in body and "[+]slice-publisher" in body
            after = _sample("gpu_dra_request_duration_seconds_count", operation="prepare", result="success")
            assert after == before
            await dra.stop(None)
            dra_socket.unlink(missing_ok=True)
            deadline = time.monotonic() + 10  # the last result is reused for up to a second
            while (answer := await _fetch(port, "/livez"))[0] == 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)  # the poll interval
            status, body = answer
            assert status == 503 and "dra-socket" in body and "is gone" in body
        finally:
            await server.stop()
            await reg.stop(None)
            await dra.stop(None)

    asyncio.run(main())


def test_timed_request_counts_claims_by_result() -> None:
    def counts() -> tuple[float, float, float]:
        return (
            _sample("gpu_dra_claims_total", operation="unprepare", result="success"),
            _sample("gpu_dra_claims_total", operation="unprepare", result="error"),
            _sample("gpu_dra_request_duration_seconds_count", operation="unprepare", result="error"),
        )

    ok0, err0, calls0 = counts()
    with metrics.timed_request("unprepare") as outcomes:
        assert _sample("gpu_dra_requests_inflight", operation="unprepare") == 1
        time.sleep(0.01)  # not a wait: a request that takes some time
        outcomes.extend(["success", "error", "success"])
    ok1, err1, calls1 = counts()
    assert (ok1 - ok0, err1 - err0, calls1 - calls0) == (2, 1, 1)
    assert _sample("gpu_dra_requests_inflight", operation="unprepare") == 0
    with pytest.raises(ValueError), metrics.timed_request("unprepare"):
        raise ValueError("boom")
    assert counts()[2] - calls1 == 1


def test_api_error_labels() -> None:
    class Status(Exception):
        status = 409

    before = _sample("gpu_dra_api_errors_total", component="publisher", code="409")
    metrics.api_error("publisher", Status())
    metrics.api_error("publisher", OSError("connection refused"))
    assert _sample("gpu_dra_api_errors_total", component="publisher", code="409") == before + 1
    assert _sample("gpu_dra_api_errors_total", component="publisher", code="network") >= 1


def test_a_probe_flood_runs_the_checks_at_most_once_a_second_and_is_capped() -> None:
    """200 concurrent /livez requests share one run of the checks; requests beyond the cap
    are answered 503 at once; the checks run again only after the interval."""
    started = asyncio.Event()
    release = asyncio.Event()

    async def slow() -> CheckResult:
        started.set()
        await release.wait()
        return CheckResult("slow", True)

    async def main() -> None:
        server = ProbeServer(metrics.REGISTRY, liveness=[slow], max_in_flight=8, interval=3600)
        port = await server.start("127.0.0.1", 0)
        try:
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

            async def get() -> int:
                async with session.get(f"http://127.0.0.1:{port}/livez") as response:
                    return response.status

            flood = [asyncio.create_task(get()) for _ in range(40)]
            await asyncio.wait_for(started.wait(), 10)
            deadline = time.monotonic() + 10
            while server._in_flight < 8 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the poll interval: wait for the cap to fill
            release.set()
            answers = await asyncio.gather(*flood)
            await session.close()
            assert answers.count(200) >= 8 and set(answers) <= {200, 503}, answers
            assert 503 in answers, "no request was refused above the cap"
            assert server.runs == 1, f"the checks ran {server.runs} times for one flood"
            assert (await _fetch(port, "/livez"))[0] == 200
            assert server.runs == 1, "within the interval the result is reused"
        finally:
            await server.stop()

    asyncio.run(main())


def test_the_port_is_served_off_the_daemons_loop_and_a_blocked_loop_fails_liveness() -> None:
    """Scrapes do not queue on the loop that serves the kubelet: with that loop blocked,
    /metrics is still answered, and /livez says that the loop does not run (503)."""
    answers: dict[str, tuple[int, str]] = {}
    done = threading.Event()

    def client(port: int) -> None:
        try:
            answers["/metrics"] = _get(port, "/metrics")
            answers["/livez"] = _get(port, "/livez")
        finally:
            done.set()

    async def main() -> None:
        server = ProbeServer(metrics.SERVED, liveness=[_ok], interval=0.0, loop_timeout=0.5)
        port = await server.start("127.0.0.1", 0)
        try:
            thread = threading.Thread(target=client, args=(port,))
            thread.start()
            done.wait(timeout=30)  # blocks this loop, the daemon's, on purpose, until the client is done
            thread.join()
            assert (await _fetch(port, "/livez"))[0] == 200, "the loop runs again: live again"
        finally:
            await server.stop()

    asyncio.run(main())
    assert answers["/metrics"][0] == 200
    assert answers["/livez"][0] == 503 and "event-loop" in answers["/livez"][1], answers["/livez"]


# The HTTP itself (h11 over asyncio streams): raw bytes from a client in the test's loop, so
# that what the server does with a malformed, oversized or slow request is what is checked.


async def _response(reader: asyncio.StreamReader, head: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers (lower-cased names) and body (none for HEAD)."""
    lines = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode().split("\r\n")
    fields = (line.split(": ", 1) for line in lines[1:] if line)
    headers = {name.lower(): value for name, value in fields}
    body = b"" if head else await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 5)
    return int(lines[0].split()[1]), headers, body


async def _closed(reader: asyncio.StreamReader, within: float = 5) -> bool:
    """Whether the server closes the connection within `within` s (what it still sends is dropped)."""
    try:
        async with asyncio.timeout(within):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def _serving(test: Callable[[int], Awaitable[None]], **fields: Any) -> None:
    """Run `test(port)` against a ProbeServer on loopback, in a loop of its own."""

    async def main() -> None:
        server = ProbeServer(metrics.SERVED, liveness=[_ok], **fields)
        port = await server.start("127.0.0.1", 0)
        try:
            await test(port)
        finally:
            await server.stop()

    asyncio.run(main())


def test_an_oversized_head_is_refused_and_the_next_connection_served() -> None:
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n")
        status, _, _ = await _response(reader)
        assert status in (431, 400)
        assert await _closed(reader)
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _response(reader))[0] == 200
        writer.close()

    _serving(test)


def test_a_body_over_a_kibibyte_gets_413_and_a_small_one_is_read_and_dropped() -> None:
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /livez HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789"
                     b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _response(reader))[0] == 200
        assert (await _response(reader))[0] == 200, "the small body was not taken for the next request"
        writer.close()
        for request in (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n" + b"b" * 2000,
                        b"POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                        + b"320\r\n" + b"c" * 800 + b"\r\n" + b"320\r\n" + b"c" * 800 + b"\r\n0\r\n\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            status, headers, _ = await _response(reader)
            assert status == 413 and headers.get("connection") == "close"
            assert await _closed(reader)
            writer.close()

    _serving(test)


def test_methods_paths_garbage_and_head(caplog: pytest.LogCaptureFixture) -> None:
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /livez HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        status, headers, _ = await _response(reader)
        assert status == 405 and headers["allow"] == "GET, HEAD"
        writer.write(b"GET /nothing?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _response(reader))[0] == 404
        writer.write(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, _ = await _response(reader, head=True)
        assert status == 200 and int(headers["content-length"]) > 1000
        assert headers["content-type"].startswith("text/plain; version=")
        # the next bytes are the answer to this: HEAD sent no body
        writer.write(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = await _response(reader)
        assert (status, body) == (200, b"[+]always\nok\n")
        assert headers["content-type"] == "text/plain; charset=utf-8"
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello there\r\n\r\n")
        assert (await _response(reader))[0] == 400
        assert await _closed(reader)
        writer.close()

    with caplog.at_level("DEBUG"):
        _serving(test)
    assert not [r for r in caplog.records if r.exc_info or r.levelname in ("ERROR", "CRITICAL")]


def test_keep_alive_serves_requests_in_turn_until_connection_close() -> None:
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for path in (b"/metrics", b"/livez", b"/metrics"):
            writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, _ = await _response(reader)
            assert status == 200 and "connection" not in headers
        writer.write(b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, headers, _ = await _response(reader)
        assert status == 200 and headers["connection"] == "close"
        assert await _closed(reader, within=1)
        writer.close()

    _serving(test)


def test_a_silent_or_trickling_client_is_dropped_after_the_timeout() -> None:
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        assert await _closed(reader, within=5), "a client that sends nothing was kept"
        assert time.monotonic() - started < 2
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                for byte in b"GET /livez HTTP/1.1\r\nHost: " + b"x" * 200:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.02)  # a byte every 20 ms: never a whole head

        sending = asyncio.create_task(trickle())
        assert await _closed(reader, within=5), "a client that trickles its head was kept"
        assert time.monotonic() - started < 2
        sending.cancel()
        writer.close()

    _serving(test, keepalive=0.2)


def test_idle_connections_past_the_cap_never_keep_a_probe_out() -> None:
    """600 idle connections against a cap of 512 (the outside run's flood): every new
    connection is served, the longest idle ones are closed to make room, and the newest
    stay open."""
    async def test(port: int) -> None:
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(600)]
        statuses: list[int | str] = []
        for _ in range(5):  # the kubelet's probes: a fresh connection each, as Go's prober opens
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            try:
                statuses.append((await asyncio.wait_for(_response(reader), 5))[0])
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                statuses.append(type(e).__name__)
            writer.close()
        closed = await asyncio.gather(*(_closed(r, within=1) for r, _ in idle[:85]))
        newest = await asyncio.gather(*(_closed(r, within=0.2) for r, _ in idle[-400:]))
        for _, writer in idle:
            writer.close()
        assert statuses == [200] * 5, f"probes past 600 idle connections: {statuses}"
        assert all(closed), f"{closed.count(False)} of the 85 longest idle connections still open"
        assert not any(newest), f"{newest.count(True)} of the 400 newest connections closed"

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"the hard open-files limit here is {hard}: too low for both ends of 600 connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1400), hard))
    _serving(test, keepalive=30)


def test_stop_closes_every_open_connection() -> None:
    async def main() -> None:
        server = ProbeServer(metrics.SERVED, liveness=[_ok])
        port = await server.start("127.0.0.1", 0)
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _response(reader))[0] == 200
        started = time.monotonic()
        await server.stop()
        assert time.monotonic() - started < 2, "stop waited for the connections' keep-alive to end"
        assert await _closed(reader, within=2) and await _closed(idle_reader, within=2)
        writer.close()
        idle_writer.close()

    asyncio.run(main())
