"""ResourceClaims whose allocation the test writes by hand, for fault tests the scheduler would not produce.

What a buggy or hostile scheduler, or an admin with kubectl, could write into
`status.allocation`: any pool, any device, the same device twice. The API server accepts
it, so the plugin has to cope with it. Nothing here talks to the plugin.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client

from dra_driver import DEFAULT_DRIVER_NAME
from tests.harness.objects import sync_request

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"


def allocated_claim(
    api: client.ApiClient,
    namespace: str,
    name: str,
    results: list[dict[str, str]] | None,
    device_class: str,
    driver: str = DEFAULT_DRIVER_NAME,
    parameters: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A claim for as many devices of `device_class` as `results` has (one if None), with
    `results` written as its allocation (each `{"pool", "device"}`, request "gpu");
    unallocated if `results` is None. `parameters`: the driver's opaque configuration, in the
    claim and, as the scheduler copies it, in its allocation."""
    opaque = {"driver": driver, "parameters": parameters}
    request = {"name": "gpu", "exactly": {"deviceClassName": device_class, "count": len(results or [None])}}
    devices_asked: dict[str, Any] = {"requests": [request]}
    if parameters is not None:
        devices_asked["config"] = [{"requests": ["gpu"], "opaque": opaque}]
    claim: dict[str, Any] = sync_request(
        api,
        "POST",
        CLAIMS.format(ns=namespace),
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": devices_asked},
        },
    )
    if results is None:
        return claim
    devices: dict[str, Any] = {"results": [{"request": "gpu", "driver": driver, **r} for r in results]}
    if parameters is not None:
        devices["config"] = [{"source": "FromClaim", "requests": ["gpu"], "opaque": opaque}]
    claim["status"] = {"allocation": {"devices": devices}}
    updated: dict[str, Any] = sync_request(api, "PUT", f"{CLAIMS.format(ns=namespace)}/{name}/status", claim)
    return updated
