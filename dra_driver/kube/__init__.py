"""Kubernetes API access for the daemon (asyncio, like everything in it).

One thin JSON layer, as kopf has: connect with a kubeconfig or the in-cluster service
account, send JSON to any path and get plain dicts back, follow a watch as a stream of
(type, object) events. The driver works on plain JSON (what the API server sends) rather
than generated models, so that fields from a newer server are never dropped on the way.

Who we are to the API server and where it is: `dra_driver.kube.credentials`; the
connections (asyncio streams; HTTP/2 streams of one connection to a far server whose TLS
chooses "h2", else HTTP/1.1): `dra_driver.kube.transport` and `dra_driver.kube.http2`.

Resilience, in `request` and `watch` alone, every attempt inside the caller's deadline:
a 429 is retried for any method after its Retry-After (API Priority and Fairness rejects a
request before acting on it); a connection that could not be opened is retried for any
method (the request never left); a 5xx or a connection that broke after the request went out
is retried only for GET (list, get and watch), because a create, update, patch or delete may
already have been applied, and repeating it could create a second object or fail on the
first one's effects; the caller's reconcile loop decides what to do next. A 5xx whose body
is over MAX_ERROR_BODY_BYTES is not one the API server wrote (a Status is a few hundred
bytes): it is not read further and not retried.

Bounded, whatever the server sends: a body is read incrementally and refused past its cap
(`TooLarge`, an ApiException, past MAX_BODY_BYTES by default: a claim or a slice is at
most about 1.5 MiB in etcd), never held whole and then decoded; a watch event past
MAX_BODY_BYTES likewise. A LIST goes by pages (`list_all`: `limit` and `continue`), and a
page over the cap is asked again, from the same place, with a quarter of its `limit`, so
that a list of large objects (150 MiB of claims) is never more than one capped page in
memory, and a caller's filter (`keep`) holds only what it keeps.

It must NOT follow proxy variables (the in-cluster service address is never behind a
proxy), retry past the caller's deadline, cache anything the API server owns, or grow typed
models or per-resource helpers: callers own their paths and their JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlencode, urlsplit

from dra_driver.jsontypes import JSON
from dra_driver.kube.credentials import SERVICE_ACCOUNT, Credentials, from_kubeconfig, in_cluster, unverified
from dra_driver.kube.response import CouldNotConnect, Response
from dra_driver.kube.transport import Pool

if TYPE_CHECKING:
    from collections.abc import Sequence

ATTEMPTS = 4
FIRST_BACKOFF_SECONDS = 0.25
MAX_RETRY_AFTER_SECONDS = 10.0
CONNECTIONS = 64  # default per client: its requests at once (the controller's writes for a fleet share them)
WATCH_GRACE_SECONDS = 30  # how long past its timeoutSeconds a watch may take to end
RETRIED_AFTER_SENDING = frozenset({"GET"})
MAX_BODY_BYTES = 16 * 2**20  # one answer or watch event; lists are paged to fit
MAX_ERROR_BODY_BYTES = 64 * 2**10  # an error's Status is a few hundred bytes
LIST_PAGE = 500  # items asked for per LIST page, as client-go's pager does
_LIST_HINT = " (a LIST is read in pages: kube.list_all)"

_T = TypeVar("_T")


class ApiException(Exception):
    """The API server answered with an HTTP error."""

    def __init__(
        self, status: int, reason: str = "", body: str = "", retry_after: float | None = None
    ) -> None:
        super().__init__(f"HTTP {status} {reason}: {body[:300]}" if body else f"HTTP {status} {reason}")
        self.status = status
        self.reason = reason
        self.body = body
        self.retry_after = retry_after
        self.complete = True  # False: the body was cut at MAX_ERROR_BODY_BYTES


class TooLarge(ApiException):
    """An answer (or one watch event) larger than the client takes: an error, not an OOM."""

    def __init__(self, what: str, limit: int, status: int = 200, hint: str = "") -> None:
        message = (
            f"{what}: the API server's answer is larger than {limit / 2**20:g} MiB, the most this "
            f"client reads; not read further{hint}"
        )
        super().__init__(status, "answer too large", message)
        self.args = (message,)


# What a request or a watch raises when the API server is slow, down or restarting.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    ApiException,
    OSError,  # ConnectionError (a connection that broke or never opened), ssl.SSLError
    TimeoutError,
)

__all__ = [
    "JSON",
    "TRANSIENT_ERRORS",
    "ApiClient",
    "ApiException",
    "TooLarge",
    "list_all",
    "load_client",
    "request",
    "watch",
]


class ApiClient:
    """Keep-alive connections to one API server, and who we are to it."""

    def __init__(
        self, credentials: Credentials, connections: int = CONNECTIONS, http2: bool | None = None
    ) -> None:
        self.server = credentials.server.rstrip("/")
        url = urlsplit(self.server)
        if url.scheme not in ("https", "http") or not url.hostname:
            raise ValueError(f"API server address {credentials.server!r} is not an http(s)://host[:port] URL")
        context = credentials.ssl_context
        if context is True:
            context = ssl.create_default_context()
        elif context is False:
            context = unverified()
        self._ssl: ssl.SSLContext = context
        self._authorization = credentials.authorization
        self._prefix = url.path  # a server URL may carry a path (behind a proxy)
        port = url.port or (443 if url.scheme == "https" else 80)
        tls = self._ssl if url.scheme == "https" else None
        # HTTP/1.1: at most `connections` open, a request past them waits for a free one;
        # HTTP/2 (the server offers it and, unless `http2`, is far): streams of one connection.
        self._pool = Pool(url.hostname, port, tls, credentials.server_hostname, connections, http2)

    @property
    def address(self) -> tuple[str, int]:
        """The host and port connected to."""
        return self._pool.address

    def target(self, path: str, query: Mapping[str, str] | None) -> str:
        # urlencode quotes a continue token's '+' as %2B, as the server needs it.
        return self._prefix + path + (f"?{urlencode(query)}" if query else "")

    async def headers(self, content_type: str | None) -> Sequence[tuple[str, str]]:
        headers = [("Accept", "application/json"), ("User-Agent", "dra-driver")]
        if content_type:
            headers.append(("Content-Type", content_type))
        auth = await self._authorization()
        if auth:
            headers.append(("Authorization", auth))
        return headers

    async def send(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None,
        payload: bytes | None,
        content_type: str,
    ) -> Response:
        """One attempt; the caller reads the response and releases it."""
        headers = await self.headers(content_type if payload is not None else None)
        return await self._pool.send(method, self.target(path, query), headers, payload)

    async def close(self) -> None:
        await self._pool.close()


async def load_client(kubeconfig: str | None = None, connections: int = CONNECTIONS) -> ApiClient:
    """A client for `kubeconfig`, else the in-cluster service account, else ~/.kube/config,
    with at most `connections` connections open at once."""
    if kubeconfig:
        return ApiClient(await from_kubeconfig(Path(kubeconfig)), connections)
    if os.environ.get("KUBERNETES_SERVICE_HOST") and (SERVICE_ACCOUNT / "token").exists():
        return ApiClient(in_cluster(os.environ, SERVICE_ACCOUNT), connections)
    default = Path(os.environ.get("KUBECONFIG", "~/.kube/config")).expanduser()
    return ApiClient(await from_kubeconfig(default), connections)


# --- requests ----------------------------------------------------------------------------

# A connection that broke or never opened (response.CouldNotConnect), or its TLS failed.
# Not OSError as a whole: TimeoutError is one, and the caller's deadline is not a broken connection.
_BROKEN: tuple[type[Exception], ...] = (ConnectionError, ssl.SSLError)
_RETRIED: tuple[type[Exception], ...] = (ApiException, *_BROKEN)


def _backoff(attempt: int) -> float:
    return FIRST_BACKOFF_SECONDS * 2.0 ** (attempt - 1) * random.uniform(0.5, 1.0)


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("retry-after", "")
    return min(float(value), MAX_RETRY_AFTER_SECONDS) if value.isdigit() else None


def _delay(method: str, error: BaseException, attempt: int) -> float | None:
    """How long to wait before the next attempt, or None: do not retry."""
    if isinstance(error, ApiException):
        if error.status == 429:
            return error.retry_after if error.retry_after is not None else _backoff(attempt)
        if error.status >= 500 and method in RETRIED_AFTER_SENDING and error.complete:
            return error.retry_after if error.retry_after is not None else _backoff(attempt)
        return None
    if isinstance(error, ssl.SSLCertVerificationError):  # a certificate that failed will fail again
        return None
    # A connection error before the request left: safe to repeat for any method.
    if isinstance(error, CouldNotConnect) or method in RETRIED_AFTER_SENDING:
        return _backoff(attempt)
    return None


async def _error(response: Response) -> ApiException:
    """The error, from at most MAX_ERROR_BODY_BYTES of its body (the rest is never read)."""
    data = bytearray()
    async for chunk in response.chunks():
        data += chunk
        if len(data) > MAX_ERROR_BODY_BYTES:
            break
    complete = len(data) <= MAX_ERROR_BODY_BYTES
    body = data[:MAX_ERROR_BODY_BYTES].decode(errors="replace")
    if not complete:
        response.close()  # the connection goes with the unread rest
        body = f"(an answer over {MAX_ERROR_BODY_BYTES // 1024} KiB, not read further) {body[:300]}"
    error = ApiException(response.status, response.reason, body, _retry_after(response.headers))
    error.complete = complete
    return error


async def _body(response: Response, limit: int, what: str) -> bytearray:
    """The whole body, read a chunk at a time; TooLarge past `limit` bytes."""
    if response.content_length is not None and response.content_length > limit:
        response.close()
        raise TooLarge(what, limit, response.status, _LIST_HINT)
    data = bytearray()
    async for chunk in response.chunks():
        if len(data) + len(chunk) > limit:
            response.close()
            raise TooLarge(what, limit, response.status, _LIST_HINT)
        data += chunk
    return data


async def _retrying(
    method: str, deadline: float, attempt: Callable[[], Awaitable[_T]], attempts: int = ATTEMPTS
) -> _T:
    loop = asyncio.get_running_loop()
    for n in range(1, attempts + 1):
        try:
            return await attempt()
        except _RETRIED as e:
            delay = _delay(method, e, n)
            if delay is None or n == attempts or loop.time() + delay >= deadline:
                raise
        await asyncio.sleep(delay)
    raise AssertionError("unreachable: the last attempt returns or raises")


async def request(
    api: ApiClient,
    method: str,
    path: str,
    body: Any = None,
    query: dict[str, str] | None = None,
    content_type: str = "application/json",
    timeout: float = 30.0,
    max_bytes: int = MAX_BODY_BYTES,
    attempts: int = ATTEMPTS,
) -> JSON:
    """Send one request; return the decoded JSON body. Raises ApiException on HTTP errors,
    TooLarge for a body over `max_bytes` (not retried), TimeoutError past `timeout`
    (retries included). `attempts` 1: no retry here, for a caller that retries itself (a work
    queue), so that a write has one retry layer."""
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    payload = None if body is None else json.dumps(body).encode()

    async def attempt() -> JSON:
        async with await api.send(method, path, query, payload, content_type) as response:
            if response.status >= 400:
                raise await _error(response)
            data = await _body(response, max_bytes, f"{method} {path}")
        decoded: JSON = json.loads(data) if data else {}
        return decoded

    deadline = asyncio.get_running_loop().time() + timeout
    async with asyncio.timeout_at(deadline):
        return await _retrying(method, deadline, attempt, attempts)


async def list_all(
    api: ApiClient,
    path: str,
    query: Mapping[str, str] | None = None,
    keep: Callable[[JSON], bool] | None = None,
    progress: Callable[[int], None] | None = None,
    timeout: float = 30.0,
    page: int = LIST_PAGE,
) -> tuple[list[JSON], str]:
    """Every item of the LIST at `path` that `keep` keeps (all without it), and the list's
    resourceVersion (to watch from), read page by page. `progress(n)` after each page of a
    list of several pages (n: items kept so far). Each page has its own `timeout`. A page
    over MAX_BODY_BYTES is asked again from the same place with a quarter of the limit;
    TooLarge only if one object alone is over it."""
    items: list[JSON] = []
    limit, token, pages = page, "", 0
    while True:
        params = {**(query or {}), "limit": str(limit), **({"continue": token} if token else {})}
        try:
            got = await request(api, "GET", path, query=params, timeout=timeout)
        except TooLarge:
            if limit == 1:
                raise
            limit = max(1, limit // 4)
            continue
        pages += 1
        found = got.get("items") or []
        items.extend(found if keep is None else filter(keep, found))
        del found
        meta = got.get("metadata") or {}
        token = meta.get("continue") or ""
        if progress is not None and (pages > 1 or token):
            progress(len(items))
        if not token:
            return items, str(meta.get("resourceVersion") or "")


async def watch(
    api: ApiClient,
    path: str,
    resource_version: str,
    query: dict[str, str] | None = None,
    timeout_seconds: int = 300,
) -> AsyncIterator[tuple[str, JSON]]:
    """Follow `path`'s watch from `resource_version`; yields (event type, object).

    Ends when the server closes the stream; raises ApiException for an ERROR event
    (410 Gone means: list again). A connection that breaks is opened again from the last
    resourceVersion seen.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_seconds + WATCH_GRACE_SECONDS
    version, breaks = resource_version, 0

    async def attempt() -> Response:
        left = int(deadline - WATCH_GRACE_SECONDS - loop.time())
        q = {
            **(query or {}),
            "watch": "true",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(max(left, 1)),
        }
        response = await api.send("GET", path, q, None, "application/json")
        if response.status >= 400:
            async with response:
                raise await _error(response)
        return response

    while True:
        # The deadline covers only this function's own awaits: a timeout around the yields
        # would cancel the consumer's code between events.
        async with asyncio.timeout_at(deadline):
            response = await _retrying("GET", deadline, attempt)
        try:
            async with response:
                lines = _lines(response.chunks(), MAX_BODY_BYTES, f"watch {path}")
                while True:
                    async with asyncio.timeout_at(deadline):
                        line = await anext(lines, None)
                    if line is None:
                        return
                    event = json.loads(line)
                    if event["type"] == "ERROR":
                        status = event["object"]
                        raise ApiException(
                            status.get("code", 500), status.get("reason", ""), status.get("message", "")
                        )
                    breaks = 0
                    version = (event["object"].get("metadata") or {}).get("resourceVersion") or version
                    yield event["type"], event["object"]
        except _BROKEN:
            breaks += 1
            delay = _backoff(breaks)
            if breaks == ATTEMPTS or loop.time() + delay >= deadline:
                raise
        async with asyncio.timeout_at(deadline):
            await asyncio.sleep(delay)


async def _lines(body: AsyncIterator[bytes], limit: int, what: str) -> AsyncIterator[bytes]:
    """The body's non-empty lines, each at most `limit` bytes (else TooLarge): one event
    carrying a large ResourceSlice can be longer than any read buffer."""
    parts: list[bytes] = []
    size = 0
    async for chunk in body:
        *complete, rest = chunk.split(b"\n")
        for piece in complete:
            if size + len(piece) > limit:
                raise TooLarge(what, limit, hint=" (one watch event)")
            parts.append(piece)
            line, parts, size = b"".join(parts), [], 0
            if line.strip():
                yield line
        parts.append(rest)
        size += len(rest)
        if size > limit:
            raise TooLarge(what, limit, hint=" (one watch event)")
    line = b"".join(parts)
    if line.strip():
        yield line
