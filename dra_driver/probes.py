"""The metrics port: Prometheus metrics, liveness and readiness over plain HTTP.

`ProbeServer` answers three paths:
* `/metrics`: `dra_driver.metrics.REGISTRY` in the Prometheus text format;
* `/livez`: 200 when every liveness check passes, else 503 with what failed (the kubelet
  then restarts the container);
* `/readyz`: 200 when the liveness checks and the readiness checks pass.

It is served from the daemon's own event loop on purpose: when that loop is blocked, the
gRPC servers are too, and an unanswered probe is what makes the kubelet act. The checks
are given by the caller; two are here because they need nothing of the plugin: a gRPC
socket that must answer a call (`socket_check`), and a background loop that must not sit
in one unit of work for too long (`Heartbeat`). This module must not know what the plugin
or the publisher do; it only asks them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from dra_driver import metrics
from dra_driver.kubeletapi.dra.v1.api_pb2 import NodePrepareResourcesRequest

if TYPE_CHECKING:
    import grpc

log = structlog.get_logger(__name__)

READ_TIMEOUT_SECONDS: Final = 5.0
PROBE_CALL_TIMEOUT_SECONDS: Final = 5.0
MAX_REQUEST_BYTES: Final = 8192


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
    name: str, socket: Callable[[], Path], call: Callable[[grpc.aio.Channel], Awaitable[Any]], timeout: float
) -> Check:
    """A check that `call` on a fresh channel to the unix socket `socket()` answers within `timeout`."""

    async def check() -> CheckResult:
        import grpc  # the first probe pays for its import, not the plugin's start

        path = socket()
        if not path.exists():
            return CheckResult(name, False, f"{path} is gone")
        try:
            async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
                await asyncio.wait_for(call(channel), timeout)
        except (grpc.RpcError, TimeoutError) as e:
            return CheckResult(name, False, f"{path} does not answer: {type(e).__name__} {e}"[:300])
        return CheckResult(name, True)

    return check


@dataclass
class ProbeServer:
    """Serves /metrics, /livez and /readyz; `await start(host, port)`, then `await stop()`."""

    registry: CollectorRegistry
    liveness: Sequence[Check] = ()
    readiness: Sequence[Check] = ()
    _server: asyncio.Server | None = None
    _last_failure: str = ""

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (useful with port 0)."""
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_REQUEST_BYTES)
        bound = int(self._server.sockets[0].getsockname()[1])
        log.info("serving metrics and probes", address=host,
                 port=bound, paths=["/metrics", "/livez", "/readyz"])
        return bound

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def run_checks(self, ready: bool) -> list[CheckResult]:
        checks = [*self.liveness, *(self.readiness if ready else ())]
        results = await asyncio.gather(*(c() for c in checks), return_exceptions=True)
        return [
            r if isinstance(r, CheckResult) else CheckResult("check", False, f"{type(r).__name__}: {r}")
            for r in results
        ]

    async def _answer(self, path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path in ("/livez", "/healthz", "/readyz"):
            results = await self.run_checks(ready=path == "/readyz")
            failed = [r for r in results if not r.ok]
            body = "".join(f"[{'+' if r.ok else '-'}]{r.name} {r.detail}".rstrip() + "\n" for r in results)
            if failed:
                summary = "; ".join(f"{r.name}: {r.detail}" for r in failed)
                if summary != self._last_failure:  # once per change, not once per probe
                    log.warning("probe failing", path=path, failed=summary)
                self._last_failure = summary
                return 503, "text/plain; charset=utf-8", body.encode()
            self._last_failure = ""
            return 200, "text/plain; charset=utf-8", (body + "ok\n").encode()
        return 404, "text/plain; charset=utf-8", b"not found: try /metrics, /livez or /readyz\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_SECONDS)
            method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            path = target.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, ctype, body = 405, "text/plain; charset=utf-8", b"only GET\n"
            else:
                status, ctype, body = await self._answer(path)
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
            writer.write(
                f"HTTP/1.1 {status} {reason[status]}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + (body if method == "GET" else b"")
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError):
            pass  # a client that sent no proper request gets nothing
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def plugin_probes(dra_socket: Path, registration_socket: Path, publisher: Heartbeat | None) -> ProbeServer:
    """The kubelet plugin's probes. Live: the DRA socket answers a (claimless) Prepare call and
    the slice publisher is not stuck. Ready: also the registration socket takes connections."""

    async def empty_prepare(channel: grpc.aio.Channel) -> None:
        from dra_driver.kubeletapi.dra.v1.api_pb2_grpc import DRAPluginStub

        await DRAPluginStub(channel).NodePrepareResources(NodePrepareResourcesRequest())

    async def connects(channel: grpc.aio.Channel) -> None:
        # Not GetInfo: the plugin logs each GetInfo as the kubelet's, every probe would show.
        await channel.channel_ready()

    liveness = [socket_check("dra-socket", lambda: dra_socket, empty_prepare, PROBE_CALL_TIMEOUT_SECONDS)]
    if publisher is not None:
        liveness.append(publisher.check)
    readiness = [
        socket_check("registration-socket", lambda: registration_socket, connects, PROBE_CALL_TIMEOUT_SECONDS)
    ]
    return ProbeServer(metrics.REGISTRY, liveness, readiness)
