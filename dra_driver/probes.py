"""The metrics port: Prometheus metrics, liveness and readiness, over HTTP/1.1 parsed by h11.

`ProbeServer` answers three paths:
* `/metrics`: `dra_driver.metrics.SERVED` in the Prometheus text format, rendered at most
  once per `METRICS_INTERVAL_SECONDS` and served from that rendering meanwhile;
* `/livez`: 200 when every liveness check passes, else 503 with what failed (the kubelet
  then restarts the container);
* `/readyz`: 200 when the liveness checks and the readiness checks pass.

The HTTP is served by a thread of its own with its own event loop, not by the daemon's
loop that serves the kubelet's gRPC: anyone who can reach the port can send requests, and
parsing and answering them there queued every kubelet call behind them (the probe flood
in docs/performance-history.md). The checks themselves still run on the daemon's loop (the
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
SYN retry. What a client may make the server hold is bounded: open connections
(`MAX_CONNECTIONS`, the file descriptors the kubelet's gRPC needs too; a connection past
them is still served, and the one that has waited longest for its next request is closed
to make room, so that idle connections, however many, never keep the kubelet's probe out),
a request's head (`MAX_HEAD_BYTES`, else 431), its body (`MAX_BODY_BYTES`, else 413), and
the time it may take to send a whole request, idle keep-alive included
(`KEEPALIVE_SECONDS`); a malformed request gets 400 and its connection closed, never a
traceback in the log.

The HTTP/1.1 parsing and framing are h11's (sans-IO: it owns the protocol, this module only
moves bytes between it and asyncio's streams), not our own parser and not aiohttp (too much
resident memory for a port that answers three paths: docs/install.md, "What the plugin
costs a node"). Not `http.server` either:
it serves a thread per connection, unbounded under a flood, where here one loop thread
serves every connection with the admission above.
This module must not know what the plugin or the publisher do; it only asks them, and it
must never answer a request on the daemon's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any, Final

import h11
import structlog
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
MAX_CONNECTIONS: Final = 512  # open at once (each holds a descriptor); one more closes the longest idle
KEEPALIVE_SECONDS: Final = 5.0  # idle keep-alive, and the most a client may take to send a request
MAX_HEAD_BYTES: Final = 8192  # a request's line and headers together (aiohttp allowed 4 KiB a line)
MAX_BODY_BYTES: Final = 1024  # a request's body (none is needed): more gets 413 and the connection closed
READ_BYTES: Final = 8192  # what one read takes from a connection
PLAIN: Final = "text/plain; charset=utf-8"
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
    keepalive: float = KEEPALIVE_SECONDS  # the wait for a whole request, idle keep-alive included
    max_connections: int = MAX_CONNECTIONS
    _server: asyncio.Server | None = None
    _connections: set[asyncio.Task[Any]] = field(default_factory=set)  # their handlers, to end on stop
    # those waiting for a request, longest waiting first (dicts keep their insertion order)
    _waiting: dict[asyncio.Task[Any], asyncio.StreamWriter] = field(default_factory=dict)
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
        self._server = await asyncio.start_server(self._connection, host, port, backlog=BACKLOG)
        bound = int(self._server.sockets[0].getsockname()[1])
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
        if self._server is not None:
            self._server.close()  # no new connections; then every open one ends
            for task in self._connections:
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None
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

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client's connection: its requests one after the other, for as long as h11 says
        that both sides keep it alive, and it sends each whole request within `keepalive` s."""
        task = asyncio.current_task()
        if len(self._connections) >= self.max_connections and not self._close_longest_waiting():
            writer.transport.abort()  # every place is taken by a request being answered
            return
        if task is not None:
            self._connections.add(task)
        http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        clean = False  # closed after an answer (its bytes still go out), else aborted
        try:
            while True:
                try:
                    # One deadline for the wait and the whole request, so that a client that
                    # sends nothing, or trickles its head a byte at a time, holds nothing for
                    # longer than KEEPALIVE_SECONDS (aiohttp's idle keep-alive, which it was).
                    if task is not None:
                        self._waiting[task] = writer
                    try:
                        async with asyncio.timeout(self.keepalive):
                            request = await self._receive(http, reader)
                    finally:
                        if task is not None:
                            self._waiting.pop(task, None)
                except h11.RemoteProtocolError as e:  # malformed, or a head over MAX_HEAD_BYTES
                    if http.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                        status = e.error_status_hint
                        phrase = HTTPStatus(status).phrase.lower()
                        await self._send(http, writer, status, f"{phrase}\n".encode(), close=True)
                    clean = True
                    return
                if request is None:  # the client closed between requests
                    clean = True
                    return
                if isinstance(request, int):  # its body is too large: answered, not read
                    await self._send(http, writer, request, b"request body too large\n", close=True)
                    clean = True
                    return
                await self._respond(http, writer, request)
                if http.our_state is h11.DONE and http.their_state is h11.DONE:
                    http.start_next_cycle()
                else:  # either side said Connection: close, or spoke HTTP/1.0
                    clean = True
                    return
        except (OSError, TimeoutError, h11.ProtocolError, asyncio.CancelledError):
            pass  # the client went, was too slow, or the server stops: nothing to log per client
        finally:
            if clean:
                writer.close()
            else:
                writer.transport.abort()
            if task is not None:
                self._connections.discard(task)

    def _close_longest_waiting(self) -> bool:
        """Make room for a new connection: abort the one that has waited longest for a request
        (its handler ends on its own); False when none waits."""
        if not self._waiting:
            return False
        task = next(iter(self._waiting))
        writer = self._waiting.pop(task)
        self._connections.discard(task)
        writer.transport.abort()
        return True

    @staticmethod
    async def _receive(http: h11.Connection, reader: asyncio.StreamReader) -> h11.Request | int | None:
        """The next request, its body read and dropped; None when the client closed the
        connection between requests; 413 when the body is over MAX_BODY_BYTES."""
        request: h11.Request | None = None
        body = 0
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                # h11 refuses an incomplete head over MAX_HEAD_BYTES, but parses a complete one
                # whatever its size: until the head is in, read no further than its bound
                room = READ_BYTES if request is not None else MAX_HEAD_BYTES - len(http.trailing_data[0])
                http.receive_data(await reader.read(max(room, 1)))  # b"": the client closed
            elif isinstance(event, h11.Request):
                request = event
                declared = dict(event.headers).get(b"content-length", b"0")
                if int(declared) > MAX_BODY_BYTES:  # h11 has checked that it is a number
                    return int(HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            elif isinstance(event, h11.Data):
                body += len(event.data)
                if body > MAX_BODY_BYTES:  # chunked, no length declared
                    return int(HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            elif isinstance(event, h11.EndOfMessage) and request is not None:
                return request
            else:  # ConnectionClosed (or PAUSED, which this order of calls never meets)
                return None

    async def _respond(
        self, http: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request
    ) -> None:
        """Answer `request`: probes are bounded in run_checks, everything else is admitted
        apart (at most `max_scrapes_in_flight` being answered and sent at once)."""
        path = request.target.split(b"?", 1)[0].decode("ascii", "replace")
        head = request.method == b"HEAD"
        if path in PROBE_PATHS:
            status, body, content_type = await self._answer(request.method, path)
            await self._send(http, writer, status, body, content_type, head=head)
            return
        if self._scrapes_in_flight >= self.max_scrapes_in_flight:
            await self._send(http, writer, 503, b"too many scrapes at once\n", head=head)
            return
        self._scrapes_in_flight += 1
        try:
            status, body, content_type = await self._answer(request.method, path)
            await self._send(http, writer, status, body, content_type, head=head)
        finally:
            self._scrapes_in_flight -= 1

    async def _answer(self, method: bytes, path: str) -> tuple[int, bytes, str]:
        """Status, body and content type for a request of `method` for `path`."""
        if path != "/metrics" and path not in PROBE_PATHS:
            return 404, b"not found\n", PLAIN
        if method not in (b"GET", b"HEAD"):
            return 405, b"method not allowed\n", PLAIN
        if path == "/metrics":
            return 200, self.rendered_metrics(), CONTENT_TYPE_LATEST
        status, text = await self._probe(path)
        return status, text.encode(), PLAIN

    async def _send(self, http: h11.Connection, writer: asyncio.StreamWriter, status: int, body: bytes,
                    content_type: str = PLAIN, *, head: bool = False, close: bool = False) -> None:
        """One response with its Content-Length (for HEAD, the headers only); h11 adds
        `Connection: close` where the connection will not be kept alive."""
        headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
        if status == 405:
            headers.append(("Allow", "GET, HEAD"))
        if close:
            headers.append(("Connection", "close"))
        reason = HTTPStatus(status).phrase.encode()
        out = [http.send(h11.Response(status_code=status, headers=headers, reason=reason)) or b""]
        if not head:
            out.append(http.send(h11.Data(data=body)) or b"")
        out.append(http.send(h11.EndOfMessage()) or b"")
        writer.write(b"".join(out))  # one send, one packet: head and body apart were two of each
        if writer.transport.get_write_buffer_size():  # the kernel did not take it all at once
            async with asyncio.timeout(self.keepalive):  # a client that does not read is let go
                await writer.drain()

    def rendered_metrics(self) -> bytes:
        """The text format, rendered now or at most `metrics_interval` s ago."""
        at, body = self._rendered
        now = time.monotonic()
        if now - at >= self.metrics_interval:
            body = generate_latest(self.registry)
            self._rendered = (now, body)
            self.renders += 1
        return body

    async def _probe(self, path: str) -> tuple[int, str]:
        try:
            results = await self.run_checks(ready=path == "/readyz")
        except TooBusy:
            return 503, "too many probes at once\n"
        failed = [r for r in results if not r.ok]
        body = "".join(f"[{'+' if r.ok else '-'}]{r.name} {r.detail}".rstrip() + "\n" for r in results)
        if failed:
            summary = "; ".join(f"{r.name}: {r.detail}" for r in failed)
            if summary != self._last_failure:  # once per change, not once per probe
                log.warning("probe failing", path=path, failed=summary)
            self._last_failure = summary
            return 503, body
        self._last_failure = ""
        return 200, body + "ok\n"


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
