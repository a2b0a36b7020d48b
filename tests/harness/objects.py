"""Small helpers over the Kubernetes API for tests and the demo: fake Nodes, waiting, applying YAML.

Everything goes through the official client against a real API server; nothing here
stands in for a component. Tests, benchmarks and the demo are synchronous, so this is the
synchronous client: `sync_client` and `sync_request` are named apart from the driver's
asyncio `dra_driver.kube.load_client` and `kube.request` on purpose, so that a reader never
mistakes one for the other (and mypy catches an `await` of the wrong one).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from dra_driver.jsontypes import JSON

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 30.0, interval: float = 0.2) -> T:
    """Poll `probe` until it returns something truthy; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = probe()
            if result:
                return result
        except ApiException as e:
            last_error = e
        time.sleep(interval)
    raise TimeoutError(
        f"timed out after {timeout}s waiting for {what}"
        + (f" (last error: {last_error})" if last_error else "")
    )


def create_node(api: client.ApiClient, name: str, labels: dict[str, str] | None = None) -> Any:
    """A Node object that the scheduler will place pods on (there is no kubelet behind it)."""
    core = client.CoreV1Api(api)
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
        },
    }
    try:
        core.create_node(body)
    except ApiException as e:
        if e.status != 409:
            raise
    # The TaintNodesByCondition admission plugin marks new nodes not-ready; with no
    # kubelet and no node-lifecycle controller nothing would ever lift that taint.
    core.patch_node(name, {"spec": {"taints": []}})
    # Status is a subresource: set Ready explicitly, as a kubelet would.
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "test node without a kubelet",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
        }
    }
    return core.patch_node_status(name, status)


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _collection_path(doc: dict[str, Any], namespace: str) -> str:
    api_version: str = doc["apiVersion"]
    kind: str = doc["kind"]
    plural = _PLURALS.get(kind) or kind.lower() + "s"
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if kind in _CLUSTER_SCOPED:
        return f"{base}/{plural}"
    ns = doc.get("metadata", {}).get("namespace", namespace)
    return f"{base}/namespaces/{ns}/{plural}"


_PLURALS = {
    "DeviceClass": "deviceclasses",
    "ResourceClaimTemplate": "resourceclaimtemplates",
    "ResourceClaim": "resourceclaims",
    "ResourceSlice": "resourceslices",
    "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
    "ClusterRole": "clusterroles",
    "ClusterRoleBinding": "clusterrolebindings",
    "ServiceAccount": "serviceaccounts",
    "Namespace": "namespaces",
    "DaemonSet": "daemonsets",
}
_CLUSTER_SCOPED = {
    "DeviceClass",
    "ResourceSlice",
    "Node",
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "DeviceTaintRule",
}


def sync_request(
    api: client.ApiClient, method: str, path: str, body: Any = None, query: dict[str, str] | None = None
) -> JSON:
    """Send one request with the synchronous client; return the decoded JSON body.
    Raises ApiException on HTTP errors, as `dra_driver.kube.request` (its asyncio twin) does."""
    params = api.param_serialize(
        method=method,
        resource_path=path,
        query_params=list((query or {}).items()),
        header_params={"Content-Type": "application/json", "Accept": "application/json"},
        body=body,
        auth_settings=["BearerToken"],
    )
    response = api.call_api(*params)
    data = response.read()
    if response.status >= 400:
        raise ApiException(status=response.status, reason=response.reason, body=data.decode(errors="replace"))
    decoded: JSON = json.loads(data) if data else {}
    return decoded


def sync_client(kubeconfig: str) -> client.ApiClient:
    """A synchronous client for `kubeconfig` (the driver's own is `dra_driver.kube.load_client`)."""
    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    return client.ApiClient(cfg)


def create_device_class(api: client.ApiClient, name: str, expression: str) -> JSON:
    """A DeviceClass with one CEL selector."""
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }
    return sync_request(api, "POST", "/apis/resource.k8s.io/v1/deviceclasses", body)


def create_object(api: client.ApiClient, doc: dict[str, Any], namespace: str = "default") -> JSON:
    """POST one object given as a dict; returns the server's object."""
    return sync_request(api, "POST", _collection_path(doc, namespace), body=doc)
