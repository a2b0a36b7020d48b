"""Small helpers over the Kubernetes API for tests, benchmarks and the demo: fake Nodes, waiting,
applying YAML, reading pods and claims back and why the scheduler left a pod pending.

Everything goes through the official client against a real API server; nothing here
stands in for a component. Tests, benchmarks and the demo are synchronous, so this is the
synchronous client: `sync_client` and `sync_request` are named apart from the driver's
asyncio `dra_driver.kube.load_client` and `kube.request` on purpose, so that a reader never
mistakes one for the other (and mypy catches an `await` of the wrong one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from dra_driver.jsontypes import JSON
from tests.harness.bodies import claim_pod

T = TypeVar("T")

RESOURCE_API = "/apis/resource.k8s.io/v1"
EXTENDED_RESOURCE_CLAIM = "resource.kubernetes.io/extended-resource-claim"


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout: float = 30.0,
    interval: float = 0.2,
    detail: Callable[[], object] | None = None,
) -> T:
    """Poll `probe` until it returns something truthy and return that; past `timeout` raise
    TimeoutError naming `what`, the probe's last answer (or, given `detail`, what `detail()`
    says then) and the last API error. Use it, not a fixed sleep, before an assertion: a
    sleep long enough on an idle machine is too short on a loaded one; this only takes longer."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    result: T | None = None
    while True:
        try:
            result = probe()
            if result:
                return result
        except ApiException as e:
            last_error = e
        if time.monotonic() >= deadline:
            raise TimeoutError(_timed_out(what, timeout, result, detail, last_error))
        time.sleep(interval)  # the poll interval


async def wait_for_async(
    what: str,
    probe: Callable[[], T | None],
    timeout: float = 30.0,
    interval: float = 0.01,
    detail: Callable[[], object] | None = None,
) -> T:
    """`wait_for` inside an event loop: the loop runs on between polls."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(_timed_out(what, timeout, result, detail, None))
        await asyncio.sleep(interval)  # the poll interval


def watch_for(probe: Callable[[], T | None], seconds: float, interval: float = 0.5) -> T | None:
    """Watch a window of `seconds` in which `probe` must stay falsy (a write, an exit, a
    binding that must not happen); return its first truthy answer at once, or None when the
    window passed. The window is what the test asserts on, so it is not a sleep before a
    check: a violation ends it early, and the check covers all of it, not its last moment."""
    deadline = time.monotonic() + seconds
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() >= deadline:
            return None
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))  # the poll interval


def wait_steady(what: str, read: Callable[[], int], tolerance: int, timeout: float = 10.0,
                interval: float = 0.1) -> int:
    """Poll `read` (a process's RSS, its open descriptors) until two readings `interval` apart
    agree within `tolerance`, and return the last: the state a baseline or a count is taken in."""
    readings: list[int] = []

    def steady() -> int | None:
        now = read()
        agreed = bool(readings) and abs(now - readings[-1]) <= tolerance
        readings.append(now)
        return now if agreed else None

    return wait_for(f"{what} to settle", steady, timeout, interval, detail=lambda: readings[-5:])


async def watch_for_async(probe: Callable[[], T | None], seconds: float, interval: float = 0.01) -> T | None:
    """`watch_for` inside an event loop: the loop runs on through the window."""
    deadline = time.monotonic() + seconds
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))  # the poll interval


def _timed_out(
    what: str, timeout: float, last: object, detail: Callable[[], object] | None, error: Exception | None
) -> str:
    seen = detail() if detail is not None else last
    return (
        f"timed out after {timeout}s waiting for {what}; last seen: {str(seen)[-3000:]}"
        + (f" (last error: {error})" if error else "")
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


def delete_node_and_slices(api: client.ApiClient, name: str) -> None:
    """Removes a test's Node and every ResourceSlice published for it. The integration tests
    share one cluster: a slice left behind offers its devices to the next test's claims."""
    sync_request(api, "DELETE", "/apis/resource.k8s.io/v1/resourceslices",
                 query={"fieldSelector": f"spec.nodeName={name}"})
    try:
        client.CoreV1Api(api).delete_node(name)
    except ApiException as e:
        if e.status != 404:
            raise


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
    api: client.ApiClient,
    method: str,
    path: str,
    body: Any = None,
    query: dict[str, str] | None = None,
    content_type: str = "application/json",
) -> JSON:
    """Send one request with the synchronous client; return the decoded JSON body.
    Raises ApiException on HTTP errors, as `dra_driver.kube.request` (its asyncio twin) does."""
    params = api.param_serialize(
        method=method,
        resource_path=path,
        query_params=list((query or {}).items()),
        header_params={"Content-Type": content_type, "Accept": "application/json"},
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


def delete_object(api: client.ApiClient, doc: dict[str, Any], namespace: str = "default") -> None:
    """DELETE the object `doc` names; one that is already gone is fine."""
    try:
        sync_request(api, "DELETE", f"{_collection_path(doc, namespace)}/{doc['metadata']['name']}")
    except ApiException as e:
        if e.status != 404:
            raise


def policy_denial(api: client.ApiClient, namespace: str, body: JSON, dry_run: bool = False) -> str | None:
    """What an admission policy answered to creating the ResourceClaim, ResourceClaimTemplate
    or DeviceClass (cluster-wide: `namespace` unused) `body` (the text after "denied
    request: "); None if it was admitted."""
    if body["kind"] == "DeviceClass":
        path = "/apis/resource.k8s.io/v1/deviceclasses"
    else:
        plural = "resourceclaimtemplates" if body["kind"] == "ResourceClaimTemplate" else "resourceclaims"
        path = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/{plural}"
    try:
        sync_request(api, "POST", path, body, query={"dryRun": "All"} if dry_run else None)
    except ApiException as e:
        message = api_error(e)
        assert "denied request: " in message, message
        return message.split("denied request: ", 1)[1]
    return None


# -- applying YAML ---------------------------------------------------------------------------


def api_error(e: ApiException) -> str:
    """The API server's own message from an error response, else the HTTP reason."""
    with contextlib.suppress(ValueError, TypeError):
        message = json.loads(e.body or "").get("message")
        if message:
            return str(message)
    return f"{e.status} {e.reason}"


@dataclass(frozen=True)
class Applied:
    """What creating the documents of one file did."""

    title: str
    created: tuple[JSON, ...]
    problems: tuple[str, ...]

    def pods(self, namespace: str) -> list[tuple[str, str]]:
        return [
            (o["metadata"].get("namespace", namespace), o["metadata"]["name"])
            for o in self.created
            if o.get("kind") == "Pod"
        ]


def apply_documents(api: client.ApiClient, path: Path, namespace: str) -> Applied:
    """Create every object of a YAML file; a rejected object is recorded, not raised.

    Objects that name their own namespace (example 9) keep it; an existing Namespace is fine.
    """
    return create_documents(api, load_yaml_documents(path), namespace, path.name)


def create_documents(api: client.ApiClient, docs: Iterable[JSON], namespace: str, title: str) -> Applied:
    created: list[JSON] = []
    problems: list[str] = []
    for doc in docs:
        what = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            obj = create_object(api, doc, namespace)
        except ApiException as e:
            if e.status == 409 and doc.get("kind") == "Namespace":
                continue
            problems.append(f"{what} rejected by the API server: {api_error(e)}")
            continue
        obj.setdefault("kind", doc.get("kind"))
        created.append(obj)
    return Applied(title=title, created=tuple(created), problems=tuple(problems))


def create_namespace(api: client.ApiClient, name: str, labels: dict[str, str] | None = None) -> None:
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
    try:
        sync_request(api, "POST", "/api/v1/namespaces", body)
    except ApiException as e:
        if e.status != 409:
            raise
    # Pods are refused until the namespace's default service account exists; the
    # controller-manager makes it, seconds later on a loaded machine: make it now.
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}
    try:
        sync_request(api, "POST", f"/api/v1/namespaces/{name}/serviceaccounts", account)
    except ApiException as e:
        if e.status != 409:
            raise


# -- pods, claims, scheduler ----------------------------------------------------------------


def pinned_pod(name: str, node: str, claim: str, command: Sequence[str] = ("sleep", "1")) -> JSON:
    """A busybox pod on `node` whose one container uses the ResourceClaim `claim`."""
    return claim_pod(name, {"resourceClaimName": claim}, node, command=command)


def get_pod(api: client.ApiClient, namespace: str, name: str) -> JSON:
    return sync_request(api, "GET", f"/api/v1/namespaces/{namespace}/pods/{name}")


def get_claim(api: client.ApiClient, namespace: str, name: str) -> JSON:
    return sync_request(api, "GET", f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims/{name}")


def unschedulable_message(pod: JSON) -> str | None:
    """The PodScheduled=False condition's message, once the scheduler gave up on a pass."""
    for cond in pod.get("status", {}).get("conditions", []):
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return str(cond.get("message") or cond.get("reason") or "unschedulable")
    return None


def pod_events(api: client.ApiClient, namespace: str, pod: str) -> list[JSON]:
    """The events whose involved object is the pod."""
    events: list[JSON] = sync_request(
        api,
        "GET",
        f"/api/v1/namespaces/{namespace}/events",
        query={"fieldSelector": f"involvedObject.kind=Pod,involvedObject.name={pod}"},
    )["items"]
    return events


def scheduler_reason(api: client.ApiClient, namespace: str, pod: str) -> str:
    """Why a pod is not bound: its newest FailedScheduling event, else its PodScheduled
    condition, else its newest Warning event from another component (a missing claim
    template stops a pod before the scheduler ever tries it)."""
    events = pod_events(api, namespace, pod)
    failed = [e for e in events if e.get("reason") == "FailedScheduling"]
    if failed:
        return event_text(max(failed, key=event_order))
    condition = unschedulable_message(get_pod(api, namespace, pod))
    if condition:
        return condition
    warnings = [e for e in events if e.get("type") == "Warning"]
    return event_text(max(warnings, key=event_order)) if warnings else ""


def event_order(event: JSON) -> int:
    """Newest last: the order the API server stored the events in."""
    return int(event["metadata"].get("resourceVersion") or 0)


def event_text(event: JSON) -> str:
    """`reason: message` of an event, from either Events API."""
    return f"{event.get('reason')}: {event.get('message') or event.get('note') or ''}".strip()


def wait_settled(api: client.ApiClient, pods: Sequence[tuple[str, str]], timeout: float = 30.0) -> None:
    """Wait until each pod is bound to a node or the scheduler has reported it unschedulable."""
    deadline = time.monotonic() + timeout
    waiting = list(pods)
    while waiting and time.monotonic() < deadline:
        still: list[tuple[str, str]] = []
        for ns, name in waiting:
            try:
                pod = get_pod(api, ns, name)
            except ApiException:
                still.append((ns, name))
                continue
            if not pod["spec"].get("nodeName") and unschedulable_message(pod) is None:
                still.append((ns, name))
        waiting = still
        if waiting:
            time.sleep(0.2)  # the poll interval


def pod_claim_names(pod: JSON) -> list[tuple[str, str]]:
    """(claim name, origin) of every ResourceClaim a pod uses, in the pod's order."""
    status = pod.get("status", {})
    statuses = {s["name"]: s.get("resourceClaimName") for s in status.get("resourceClaimStatuses", [])}
    names: list[tuple[str, str]] = []
    for ref in pod["spec"].get("resourceClaims", []):
        if ref.get("resourceClaimName"):
            names.append((ref["resourceClaimName"], "claim"))
        elif statuses.get(ref["name"]):
            names.append((str(statuses[ref["name"]]), "template"))
    extended = status.get("extendedResourceClaimStatus", {}).get("resourceClaimName")
    if extended:
        names.append((str(extended), "extended resource"))
    return names


def allocation_results(claim: JSON) -> list[JSON]:
    allocation = claim.get("status", {}).get("allocation") or {}
    results: list[JSON] = allocation.get("devices", {}).get("results", [])
    return results
