"""The metrics port: Prometheus metrics, liveness and readiness, served by aiohttp's web server.

`ProbeServer` answers three paths:
* `/metrics`: `dra_driver.metrics.SERVED` in the Prometheus text format, rendered at most
  once per `METRICS_INTERVAL_SECONDS` and served from that rendering meanwhile;
* `/livez`: 200 when every liveness check passes, else 503 with what failed (the kubelet
  then restarts the container);
* `/readyz`: 200 when the liveness checks and the readiness checks pass.

The HTTP is served by a thread of its own with its own event loop, not by the daemon's
loop that serves the kubelet's gRPC: anyone who can reach the port can send requests, and
parsing and answering them there queued every kubelet call behind them (Prepare p50 2x
quiet under 1,000 requests/s). The checks themselves still run on the daemon's loop (the
loop `start` was awaited on), handed over once per run: when that loop is blocked, the gRPC
servers are too, and the probe then fails (`LOOP_TIMEOUT_SECONDS`), which is what makes the
kubelet act. A probe must cost the node next to nothing: the checks run at most once per
`CHECK_INTERVAL_SECONDS` whatever the request rate (concurrent requests share one run,
later ones its result), they only open and close a connection to each socket (never a gRPC
call, never NodePrepareResources), and at most `MAX_IN_FLIGHT` probes wait for a run: the
others are answered at once with the previous run's results (503 only before the first run
has ended), so that a flood of probes cannot starve the kubelet's.
Scrapes are admitted apart (`MAX_SCRAPES_IN_FLIGHT`, other paths with them): a flood of
/metrics never takes the places of /livez and /readyz. The accept backlog is `BACKLOG`,
not a cap, so that a flood's connections do not leave the kubelet's probe waiting for a
SYN retry. The HTTP is aiohttp's (already installed for the API client), not our own.
This module must not know what the plugin or the publisher do; it only asks them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from dra_driver import metrics

log = structlog.get_logger(__name__)

PROBE_CONNECT_TIMEOUT_SECONDS: Final = 5.0
CHECK_INTERVAL_SECONDS: Final = 1.0  # the checks run at most this often, whatever the request rate
MAX_IN_FLIGHT: Final = 16  # probes being answered at once; more get 503 at once
MAX_SCRAPES_IN_FLIGHT: Final = 4  # /metrics (and any other path) answered at once, apart from probes
METRICS_INTERVAL_SECONDS: Final = 1.0  # /metrics is rendered at most this often
BACKLOG: Final = 128
KEEPALIVE_SECONDS: Final = 5.0
LOOP_TIMEOUT_SECONDS: Final = 5.0  # the daemon's loop must run a round of checks within this
PROBE_PATHS: Final = frozenset({"/livez", "/healthz", "/readyz"})


class TooBusy(Exception):
    """More probes than MAX_IN_FLIGHT wait for the first run of the checks."""


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str = ""


Check = Callable[[], Awaitable[CheckResult]]


@dataclass
class Heartbeat:
    """Progress of a background loop: `busy()` when it starts a unit of work, `idle()` when it
    is done. Waiting (on a watch, on a lease, in a backoff) is idle; stuck means busy for longer
    than `stuck_after` seconds. A loop that has ended is stuck too (`ended()`)."""

    name: str
    stuck_after: float
    busy_since: float | None = None
    ended_with: str | None = None
    beats: int = 0

    def busy(self) -> None:
        if self.busy_since is None:
            self.busy_since = time.monotonic()

    def idle(self) -> None:
        self.busy_since = None
        self.beats += 1

    def ended(self, why: str) -> None:
        self.ended_with = why

    def task_ended(self, task: asyncio.Task[Any]) -> None:
        """A done-callback for the loop's task: a loop that returns or fails has stopped working."""
        if not task.cancelled():
            error = task.exception()
            self.ended(f"{type(error).__name__}: {error}" if error else "returned")

    async def check(self) -> CheckResult:
        if self.ended_with is not None:
            return CheckResult(self.name, False, f"stopped: {self.ended_with}")
        if self.busy_since is not None:
            busy = time.monotonic() - self.busy_since
            if busy > self.stuck_after:
                return CheckResult(self.name, False, f"one unit of work running for {busy:.0f} s")
        return CheckResult(self.name, True)


def socket_check(
    name: str, socket: Callable[[], Path], timeout: float = PROBE_CONNECT_TIMEOUT_SECONDS
) -> Check:
    """A check that the unix socket `socket()` accepts a connection within `timeout`; the
    connection is closed at once, so the server behind it sees no call."""

    async def check() -> CheckResult:
        path = socket()
        if not path.exists():
            return CheckResult(name, False, f"{path} is gone")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), timeout)
        except (OSError, TimeoutError) as e:
            return CheckResult(name, False, f"{path} does not accept: {type(e).__name__} {e}"[:300])
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return CheckResult(name, True)

    return check


@dataclass
class _Cached:
    at: float = -1e9
    results: list[CheckResult] = field(default_factory=list)
    running: asyncio.Task[list[CheckResult]] | None = None


@dataclass
class ProbeServer:
    """Serves /metrics, /livez and /readyz; `await start(host, port)`, then `await stop()`."""

    registry: Collector
    liveness: Sequence[Check] = ()
    readiness: Sequence[Check] = ()
    interval: float = CHECK_INTERVAL_SECONDS
    max_in_flight: int = MAX_IN_FLIGHT
    max_scrapes_in_flight: int = MAX_SCRAPES_IN_FLIGHT
    metrics_interval: float = METRICS_INTERVAL_SECONDS
    runs: int = 0  # how many times the checks ran (tests and the probe-flood benchmark read it)
    renders: int = 0  # how many times /metrics was rendered
    loop_timeout: float = LOOP_TIMEOUT_SECONDS
    _runner: web.AppRunner | None = None
    _owner: asyncio.AbstractEventLoop | None = None  # the daemon's loop: the checks run there
    _loop: asyncio.AbstractEventLoop | None = None  # the HTTP thread's loop
    _thread: threading.Thread | None = None
    _stopping: asyncio.Event | None = None
    _cached: dict[bool, _Cached] = field(default_factory=lambda: {False: _Cached(), True: _Cached()})
    _in_flight: int = 0  # probes waiting for a run of the checks
    _scrapes_in_flight: int = 0  # everything but probes
    _rendered: tuple[float, bytes] = (-1e9, b"")
    _last_failure: str = ""

    async def start(self, host: str, port: int) -> int:
        """Listen from a thread of its own; returns the port (useful with port 0). The checks
        will run on the loop this is awaited on."""
        self._owner = asyncio.get_running_loop()
        bound: asyncio.Future[int] = self._owner.create_future()
        owner = self._owner

        def settle(port: int | None, error: BaseException | None) -> None:
            if bound.done():
                return
            if error is not None:
                bound.set_exception(error)
            else:
                bound.set_result(int(port or 0))

        def serve() -> None:
            async def main() -> None:
                self._loop = asyncio.get_running_loop()
                self._stopping = asyncio.Event()
                try:
                    listening = await self._listen(host, port)
                except BaseException as e:
                    owner.call_soon_threadsafe(settle, None, e)
                    return
                owner.call_soon_threadsafe(settle, listening, None)
                try:
                    await self._stopping.wait()
                finally:
                    await self._cleanup()

            asyncio.run(main())

        self._thread = threading.Thread(target=serve, name="metrics-port", daemon=True)
        self._thread.start()
        try:
            return await bound
        except BaseException:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            raise

    async def _listen(self, host: str, port: int) -> int:
        app = web.Application(middlewares=[self._cap], client_max_size=1024)
        app.router.add_get("/metrics", self._metrics)
        for path in ("/livez", "/healthz", "/readyz"):
            app.router.add_get(path, self._probe)
        self._runner = web.AppRunner(
            app, access_log=None, keepalive_timeout=KEEPALIVE_SECONDS, max_line_size=4096, max_field_size=4096
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=BACKLOG)
        await site.start()
        bound = int(self._runner.addresses[0][1])
        log.info("serving metrics and probes", address=host,
                 port=bound, paths=["/metrics", "/livez", "/readyz"])
        return bound

    async def stop(self) -> None:
        thread, loop, stopping = self._thread, self._loop, self._stopping
        if thread is None or loop is None or stopping is None:
            return
        with contextlib.suppress(RuntimeError):  # its loop has already ended
            loop.call_soon_threadsafe(stopping.set)
        await asyncio.to_thread(thread.join)
        self._thread = None

    async def _cleanup(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for cached in self._cached.values():
            if cached.running is not None:
                cached.running.cancel()

    async def run_checks(self, ready: bool) -> list[CheckResult]:
        """The checks' results, run now or shared: at most one run per `interval` per kind.
        While `max_in_flight` probes already wait for a run, the others get the previous
        run's results at once (a probe is never refused for the flood's sake), or, before
        the first run has ended, TooBusy."""
        cached = self._cached[ready]
        if time.monotonic() - cached.at < self.interval:
            return cached.results
        if cached.running is None:
            cached.running = asyncio.create_task(self._run(ready))
        if self._in_flight >= self.max_in_flight:
            if cached.results:
                return cached.results
            raise TooBusy
        self._in_flight += 1
        try:
            return await asyncio.shield(cached.running)
        finally:
            self._in_flight -= 1

    async def _run(self, ready: bool) -> list[CheckResult]:
        cached = self._cached[ready]
        try:
            self.runs += 1
            owner = self._owner
            if owner is None or owner is asyncio.get_running_loop():
                results = await self._checks(ready)
            else:
                handed = asyncio.run_coroutine_threadsafe(self._checks(ready), owner)
                try:
                    results = await asyncio.wait_for(asyncio.wrap_future(handed), self.loop_timeout)
                except TimeoutError:
                    late = f"the daemon's event loop did not run the checks in {self.loop_timeout:g} s"
                    results = [CheckResult("event-loop", False, late)]
            cached.results = results
            cached.at = time.monotonic()
            return cached.results
        finally:
            cached.running = None

    async def _checks(self, ready: bool) -> list[CheckResult]:
        checks = [*self.liveness, *(self.readiness if ready else ())]
        results = await asyncio.gather(*(c() for c in checks), return_exceptions=True)
        return [
            r if isinstance(r, CheckResult) else CheckResult("check", False, f"{type(r).__name__}: {r}")
            for r in results
        ]

    @web.middleware
    async def _cap(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path in PROBE_PATHS:  # bounded in run_checks
            return await handler(request)
        if self._scrapes_in_flight >= self.max_scrapes_in_flight:
            return web.Response(status=503, text="too many scrapes at once\n")
        self._scrapes_in_flight += 1
        try:
            return await handler(request)
        finally:
            self._scrapes_in_flight -= 1

    def rendered_metrics(self) -> bytes:
        """The text format, rendered now or at most `metrics_interval` s ago."""
        at, body = self._rendered
        now = time.monotonic()
        if now - at >= self.metrics_interval:
            body = generate_latest(self.registry)
            self._rendered = (now, body)
            self.renders += 1
        return body

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.rendered_metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _probe(self, request: web.Request) -> web.Response:
        path = request.path
        try:
            results = await self.run_checks(ready=path == "/readyz")
        except TooBusy:
            return web.Response(status=503, text="too many probes at once\n")
        failed = [r for r in results if not r.ok]
        body = "".join(f"[{'+' if r.ok else '-'}]{r.name} {r.detail}".rstrip() + "\n" for r in results)
        if failed:
            summary = "; ".join(f"{r.name}: {r.detail}" for r in failed)
            if summary != self._last_failure:  # once per change, not once per probe
                log.warning("probe failing", path=path, failed=summary)
            self._last_failure = summary
            return web.Response(status=503, text=body)
        self._last_failure = ""
        return web.Response(text=body + "ok\n")


def plugin_probes(dra_socket: Path, registration_socket: Path, publisher: Heartbeat | None) -> ProbeServer:
    """The kubelet plugin's probes. Live: the event loop answers (it serves this), the DRA
    socket accepts connections and the slice publisher is not stuck. Ready: also the
    registration socket accepts connections. No gRPC call is made: a probe must never reach
    NodePrepareResources nor show up in the kubelet's call metrics."""
    liveness = [socket_check("dra-socket", lambda: dra_socket)]
    if publisher is not None:
        liveness.append(publisher.check)
    readiness = [socket_check("registration-socket", lambda: registration_socket)]
    return ProbeServer(metrics.SERVED, liveness, readiness)
