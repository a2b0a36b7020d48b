"""Kubernetes API access for the daemon (asyncio, like everything in it).

One thin layer over the official client's asyncio half: build an `ApiClient` from a
kubeconfig or the in-cluster config, send JSON to any path and get plain dicts back,
and follow a watch as a stream of (type, object) events. The driver works on plain
JSON (what the API server sends) rather than generated models, so that fields from a
newer server are never dropped on the way through.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from kubernetes.aio import client, config
from kubernetes.client.exceptions import ApiException

from dra_driver.jsontypes import JSON

# What a request or a watch raises when the API server is slow, down or restarting.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    ApiException,
    OSError,
    asyncio.TimeoutError,
    aiohttp.ClientError,
)

__all__ = ["JSON", "TRANSIENT_ERRORS", "ApiException", "load_client", "request", "watch"]


async def load_client(kubeconfig: str | None = None) -> client.ApiClient:
    """A client for `kubeconfig`, else the in-cluster service account, else ~/.kube/config."""
    cfg = client.Configuration()
    if kubeconfig:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            await config.load_kube_config(client_configuration=cfg)
    if not _proxy_configured(os.environ):
        # aiohttp's trust_env looks up proxy settings and ~/.netrc on every request
        # (measured: 0.9 ms of a 3.5 ms claim GET); without proxy variables it finds nothing
        cfg.client_session_kwargs = {"trust_env": False}
    return client.ApiClient(cfg)


def _proxy_configured(env: Mapping[str, str]) -> bool:
    return any(k.lower() in ("http_proxy", "https_proxy", "all_proxy", "netrc") for k in env)


async def _serialize(
    api: client.ApiClient, method: str, path: str, body: Any, query: dict[str, str] | None, content_type: str
) -> tuple[Any, ...]:
    return tuple(
        await api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
    )


async def request(
    api: client.ApiClient,
    method: str,
    path: str,
    body: Any = None,
    query: dict[str, str] | None = None,
    content_type: str = "application/json",
    timeout: float = 30.0,
) -> JSON:
    """Send one request; return the decoded JSON body. Raises ApiException on HTTP errors."""
    params = await _serialize(api, method, path, body, query, content_type)
    response = await api.call_api(*params, _request_timeout=timeout)
    data = await response.read()
    if response.status >= 400:
        raise ApiException(status=response.status, reason=response.reason, body=data.decode(errors="replace"))
    decoded: JSON = json.loads(data) if data else {}
    return decoded


async def watch(
    api: client.ApiClient,
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
    params = await _serialize(api, "GET", path, None, q, "application/json")
    response = await api.call_api(*params, _request_timeout=timeout_seconds + 30, _preload_content=False)
    try:
        if response.status >= 400:
            data = await response.read()
            raise ApiException(
                status=response.status, reason=response.reason, body=data.decode(errors="replace")
            )
        async for line in response.response.content:
            if not line.strip():
                continue
            event = json.loads(line)
            if event["type"] == "ERROR":
                status = event["object"]
                raise ApiException(status=status.get("code", 500), reason=status.get("message", ""))
            yield event["type"], event["object"]
    finally:
        response.response.release()
