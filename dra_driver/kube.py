"""Kubernetes API access for the daemon (asyncio, like everything in it).

A thin client of our own (HTTP/1.1 from dra_driver.http1): connect with a kubeconfig or the in-cluster service
account, send JSON to any path and get plain dicts back, follow a watch as a stream of
(type, object) events. The driver works on plain JSON (what the API server sends) rather
than generated models, so that fields from a newer server are never dropped on the way.

Why not the official client's asyncio half: importing it loads the whole generated client
(measured: ~20 MiB of RSS and ~0.4 s of start-up) for what is here three functions. The
kubeconfigs that this module does not read itself (exec plugins, auth providers, basic
auth) go through the official loader, imported only then. It talks to the API server
directly: proxy variables are not followed (the in-cluster service address is never
behind one), and nothing is looked up per request (aiohttp's `trust_env` cost 0.9 ms of a
3.5 ms claim GET).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from dra_driver.http1 import ConnectionPool
from dra_driver.jsontypes import JSON

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD_SECONDS = 60.0  # bound service-account tokens are rotated by the kubelet


class ApiException(Exception):
    """The API server answered with an HTTP error."""

    def __init__(self, status: int, reason: str = "", body: str = "") -> None:
        super().__init__(f"HTTP {status} {reason}: {body[:300]}" if body else f"HTTP {status} {reason}")
        self.status = status
        self.reason = reason
        self.body = body


# What a request or a watch raises when the API server is slow, down or restarting.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    ApiException,
    OSError,  # ConnectionError, ssl.SSLError
    TimeoutError,
    EOFError,  # asyncio.IncompleteReadError: the connection ended mid-body
)

__all__ = ["JSON", "TRANSIENT_ERRORS", "ApiClient", "ApiException", "load_client", "request", "watch"]

Authorization = Callable[[], Awaitable[str | None]]


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and who we are to it, as read from a kubeconfig or a pod."""

    server: str
    ssl_context: ssl.SSLContext | bool  # False: insecure-skip-tls-verify
    authorization: Authorization


class ApiClient:
    """Keep-alive connections to one API server, and who we are to it."""

    def __init__(self, credentials: Credentials) -> None:
        self.server = credentials.server.rstrip("/")
        url = urlsplit(self.server)
        if url.scheme not in ("https", "http") or not url.hostname:
            raise ValueError(f"API server address {credentials.server!r} is not an http(s)://host[:port] URL")
        context = credentials.ssl_context
        if context is False:  # insecure-skip-tls-verify
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
        self.pool = ConnectionPool(
            host,
            url.port or (443 if url.scheme == "https" else 80),
            context if url.scheme == "https" and isinstance(context, ssl.SSLContext) else None,
        )
        self._prefix = url.path.rstrip("/")
        self._authorization = credentials.authorization

    def target(self, path: str, query: Mapping[str, str] | None) -> str:
        return f"{self._prefix}{path}" + (f"?{urlencode(query)}" if query else "")

    async def headers(self, content_type: str) -> dict[str, str]:
        headers = {"Accept": "application/json", "Content-Type": content_type, "User-Agent": "dra-driver"}
        auth = await self._authorization()
        if auth:
            headers["Authorization"] = auth
        return headers

    async def close(self) -> None:
        await self.pool.close()


async def load_client(kubeconfig: str | None = None) -> ApiClient:
    """A client for `kubeconfig`, else the in-cluster service account, else ~/.kube/config."""
    if kubeconfig:
        return ApiClient(await _from_kubeconfig(Path(kubeconfig)))
    if os.environ.get("KUBERNETES_SERVICE_HOST") and (SERVICE_ACCOUNT / "token").exists():
        return ApiClient(_in_cluster(os.environ, SERVICE_ACCOUNT))
    default = Path(os.environ.get("KUBECONFIG", "~/.kube/config")).expanduser()
    return ApiClient(await _from_kubeconfig(default))


def _static(value: str | None) -> Authorization:
    async def authorization() -> str | None:
        return value

    return authorization


def _token_file(path: Path) -> Authorization:
    """A bearer token re-read now and then: the kubelet rotates projected tokens in place."""
    cached: list[tuple[float, str]] = []

    async def authorization() -> str | None:
        now = time.monotonic()
        if not cached or now - cached[0][0] > TOKEN_REREAD_SECONDS:
            cached[:] = [(now, path.read_text().strip())]
        return f"Bearer {cached[0][1]}"

    return authorization


def _in_cluster(env: Mapping[str, str], account: Path) -> Credentials:
    host, port = env["KUBERNETES_SERVICE_HOST"], env.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return Credentials(
        server=f"https://{host}:{port}",
        ssl_context=ssl.create_default_context(cafile=str(account / "ca.crt")),
        authorization=_token_file(account / "token"),
    )


def _entry(doc: JSON, kind: str, name: str, where: Path) -> JSON:
    for item in doc.get(f"{kind}s") or []:
        if item.get("name") == name:
            found: JSON = item.get(kind) or {}
            return found
    raise ValueError(f"kubeconfig {where}: no {kind} named {name!r}")


def _material(section: JSON, key: str, base: Path) -> tuple[str | None, bytes | None]:
    """A file path (relative to the kubeconfig) or inline base64 data, as the kubeconfig has it."""
    if section.get(f"{key}-data"):
        return None, base64.b64decode(section[f"{key}-data"])
    if section.get(key):
        return str(base / section[key]), None
    return None, None


async def _from_kubeconfig(path: Path) -> Credentials:
    import yaml  # here: a plugin in a pod uses its service account and never needs YAML

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read kubeconfig {path}: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"kubeconfig {path} is not a YAML mapping")
    context = _entry(doc, "context", doc.get("current-context", ""), path)
    cluster = _entry(doc, "cluster", context.get("cluster", ""), path)
    user = _entry(doc, "user", context.get("user", ""), path)
    if any(k in user for k in ("exec", "auth-provider", "username")):
        return await _through_official_loader(path, user)
    base = path.parent
    context_ssl: ssl.SSLContext | bool
    if cluster.get("insecure-skip-tls-verify"):
        context_ssl = False
    else:
        ca_file, ca_data = _material(cluster, "certificate-authority", base)
        context_ssl = ssl.create_default_context(
            cafile=ca_file, cadata=ca_data.decode() if ca_data is not None else None
        )
        _load_client_certificate(context_ssl, user, base)
    if user.get("token"):
        authorization = _static(f"Bearer {user['token']}")
    elif user.get("tokenFile"):
        authorization = _token_file(base / user["tokenFile"])
    else:
        authorization = _static(None)
    return Credentials(server=cluster["server"], ssl_context=context_ssl, authorization=authorization)


def _load_client_certificate(context: ssl.SSLContext, user: JSON, base: Path) -> None:
    cert_file, cert_data = _material(user, "client-certificate", base)
    key_file, key_data = _material(user, "client-key", base)
    if cert_file is None and cert_data is None:
        return
    with tempfile.TemporaryDirectory(prefix="dra-kubeconfig-") as tmp:  # ssl reads only files
        if cert_data is not None:
            cert_file = str(Path(tmp) / "cert.pem")
            Path(cert_file).write_bytes(cert_data)
        if key_data is not None:
            key_file = str(Path(tmp) / "key.pem")
            Path(key_file).write_bytes(key_data)
        assert cert_file is not None
        context.load_cert_chain(cert_file, key_file)


async def _through_official_loader(path: Path, user: JSON) -> Credentials:
    """Kubeconfigs with exec plugins, auth providers or basic auth: the official client's
    loader. An exec plugin's token is fetched again every TOKEN_REREAD_SECONDS (the loader
    keeps it until its expiry, if the plugin gave one)."""
    from kubernetes.aio import client, config  # heavy: imported only for these kubeconfigs

    cfg = client.Configuration()
    loader = await config.load_kube_config(config_file=str(path), client_configuration=cfg)
    context: ssl.SSLContext | bool = False
    if cfg.verify_ssl:
        context = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
        if cfg.cert_file:
            context.load_cert_chain(cfg.cert_file, cfg.key_file)
    fetched = [time.monotonic()]

    async def authorization() -> str | None:
        now = time.monotonic()
        if "exec" in user and now - fetched[0] > TOKEN_REREAD_SECONDS:
            await loader.load_from_exec_plugin()
            cfg.api_key["BearerToken"] = loader.token
            fetched[0] = now
        header: str | None = cfg.api_key.get("BearerToken")
        if header is None and cfg.username:
            header = cfg.get_basic_auth_token()
        return header

    return Credentials(server=cfg.host, ssl_context=context, authorization=authorization)


async def request(
    api: ApiClient,
    method: str,
    path: str,
    body: Any = None,
    query: dict[str, str] | None = None,
    content_type: str = "application/json",
    timeout: float = 30.0,
) -> JSON:
    """Send one request; return the decoded JSON body. Raises ApiException on HTTP errors."""
    payload = None if body is None else json.dumps(body).encode()
    headers = await api.headers(content_type)
    async with asyncio.timeout(timeout):
        response = await api.pool.request(method, api.target(path, query), headers, payload)
    if response.status >= 400:
        raise ApiException(response.status, response.reason, response.body.decode(errors="replace"))
    decoded: JSON = json.loads(response.body) if response.body else {}
    return decoded


async def watch(
    api: ApiClient,
    path: str,
    resource_version: str,
    query: dict[str, str] | None = None,
    timeout_seconds: int = 300,
) -> AsyncIterator[tuple[str, JSON]]:
    """Follow `path`'s watch from `resource_version`; yields (event type, object).

    Ends when the server closes the stream; raises ApiException for an ERROR event
    (410 Gone means: list again).
    """
    q = {
        **(query or {}),
        "watch": "true",
        "resourceVersion": resource_version,
        "allowWatchBookmarks": "true",
        "timeoutSeconds": str(timeout_seconds),
    }
    headers = await api.headers("application/json")
    # The deadline covers only this function's own awaits: a timeout around the yields
    # would cancel the consumer's code between events.
    deadline = asyncio.get_running_loop().time() + timeout_seconds + 30
    async with contextlib.AsyncExitStack() as stack:
        async with asyncio.timeout_at(deadline):
            status, reason, _, body = await stack.enter_async_context(
                api.pool.stream("GET", api.target(path, q), headers)
            )
            if status >= 400:
                raise ApiException(status, reason, (await body.read()).decode(errors="replace"))
        lines = body.lines()
        while True:
            async with asyncio.timeout_at(deadline):
                line = await anext(lines, None)
            if line is None:
                return
            if not line.strip():
                continue
            event = json.loads(line)
            if event["type"] == "ERROR":
                error = event["object"]
                raise ApiException(error.get("code", 500), error.get("message", ""))
            yield event["type"], event["object"]
