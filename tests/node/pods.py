"""What the node tier reads back from real pods: their devices, environment, claims, events.

Helpers only: they read the API server, the kubelet's container log files and the
container processes (through /proc) and return plain data; the tests decide what is
right. Nothing here creates or deletes anything in the cluster except `create_pod`.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.harness.driver import DRIVER
from tests.harness.node import Node, descendants
from tests.harness.objects import (
    RESOURCE_API,
    allocation_results,
    create_object,
    get_claim,
    get_pod,
    pod_events,
    scheduler_reason,
    sync_request,
)

JSON = dict[str, Any]
NVIDIA_MAJOR = 195
# `ls -l` of busybox: "crw-rw-rw-    1 root     root      195,   0 Jan  1 00:00 /dev/nvidia0"
_LS_DEVICE = re.compile(r"^c\S*\s+\d+\s+\S+\s+\S+\s+(\d+),\s+(\d+)\s.*\s(/dev/nvidia\S*)$")


@dataclass(frozen=True)
class DeviceNode:
    path: str
    major: int
    minor: int


def gpu_pod(
    name: str,
    claims: dict[str, str] | None = None,
    command: str = "ls -l /dev/nvidia*; sleep 3600",
    templates: dict[str, str] | None = None,
) -> JSON:
    """A busybox pod; `claims` maps pod claim name -> ResourceClaim, `templates` -> template."""
    refs = [{"name": k, "resourceClaimName": v} for k, v in (claims or {}).items()]
    refs += [{"name": k, "resourceClaimTemplateName": v} for k, v in (templates or {}).items()]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": refs,
            "containers": [
                {
                    "name": "main",
                    "image": "busybox:1.37",
                    "command": ["sh", "-c", command],
                    "resources": {"claims": [{"name": r["name"]} for r in refs]},
                }
            ],
        },
    }


def gpu_claim(
    name: str, count: int = 1, selectors: list[str] | None = None, config: JSON | None = None
) -> JSON:
    exactly: JSON = {"deviceClassName": DRIVER, "count": count}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    devices: JSON = {"requests": [{"name": "gpu", "exactly": exactly}]}
    if config is not None:
        devices["config"] = [{"opaque": {"driver": DRIVER, "parameters": config}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": devices},
    }


def create(api: client.ApiClient, namespace: str, *docs: JSON) -> None:
    for doc in docs:
        create_object(api, doc, namespace)


def describe(api: client.ApiClient, namespace: str, pod: str) -> str:
    """The pod's phase, container states and events, for assertion messages."""
    try:
        obj = get_pod(api, namespace, pod)
    except ApiException as e:
        return f"pod {namespace}/{pod}: {e.status}"
    states = [(s["name"], s.get("state")) for s in obj.get("status", {}).get("containerStatuses", [])]
    evs = [f"{e.get('reason')}: {e.get('message')}" for e in pod_events(api, namespace, pod)]
    return f"pod {namespace}/{pod} phase={obj['status'].get('phase')} containers={states} events={evs}"


def wait_running(api: client.ApiClient, namespace: str, pod: str, timeout: float = 60.0) -> JSON:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = get_pod(api, namespace, pod)
        statuses = obj.get("status", {}).get("containerStatuses", [])
        if (
            obj["status"].get("phase") == "Running"
            and statuses
            and all("running" in (s.get("state") or {}) for s in statuses)
        ):
            return obj
        time.sleep(0.1)  # the poll interval
    raise AssertionError(
        f"not Running after {timeout}s: {describe(api, namespace, pod)}; "
        f"scheduler: {scheduler_reason(api, namespace, pod)}"
    )


def wait_gone(api: client.ApiClient, namespace: str, pod: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            get_pod(api, namespace, pod)
        except ApiException as e:
            if e.status == 404:
                return
            raise
        time.sleep(0.1)  # the poll interval
    raise AssertionError(f"pod {namespace}/{pod} still there after {timeout}s")


def delete_pod(api: client.ApiClient, namespace: str, pod: str) -> None:
    sync_request(api, "DELETE", f"/api/v1/namespaces/{namespace}/pods/{pod}")


def pod_claims(api: client.ApiClient, pod: JSON) -> dict[str, JSON]:
    """Pod claim name -> its ResourceClaim (templates resolved through the pod's status)."""
    ns = pod["metadata"]["namespace"]
    generated = {
        s["name"]: s.get("resourceClaimName") for s in pod.get("status", {}).get("resourceClaimStatuses", [])
    }
    out: dict[str, JSON] = {}
    for ref in pod["spec"].get("resourceClaims", []):
        name = ref.get("resourceClaimName") or generated.get(ref["name"])
        if name:
            out[ref["name"]] = get_claim(api, ns, name)
    return out


def container_allocations(api: client.ApiClient, pod: JSON, container: str) -> list[JSON]:
    """The allocation results a container gets: its `resources.claims` (narrowed to a request
    where it names one), plus what the scheduler mapped to it for extended resources."""
    spec = next(c for c in pod["spec"]["containers"] if c["name"] == container)
    claims = pod_claims(api, pod)
    results: list[JSON] = []
    for ref in spec.get("resources", {}).get("claims", []) or []:
        for r in allocation_results(claims[ref["name"]]):
            wanted = ref.get("request")
            if not wanted or r["request"] == wanted or r["request"].startswith(wanted + "/"):
                results.append(r)
    extended = pod.get("status", {}).get("extendedResourceClaimStatus")
    if extended:
        claim = get_claim(api, pod["metadata"]["namespace"], extended["resourceClaimName"])
        mapped = {m["requestName"] for m in extended["requestMappings"] if m["containerName"] == container}
        results += [r for r in allocation_results(claim) if r["request"] in mapped]
    return results


def claim_uids(api: client.ApiClient, pod: JSON) -> set[str]:
    uids = {c["metadata"]["uid"] for c in pod_claims(api, pod).values()}
    extended = pod.get("status", {}).get("extendedResourceClaimStatus")
    if extended:
        uids.add(
            get_claim(api, pod["metadata"]["namespace"], extended["resourceClaimName"])["metadata"]["uid"]
        )
    return uids


def logged_devices(node: Node, pod: JSON, container: str) -> list[DeviceNode]:
    """The /dev/nvidia* nodes the container listed with `ls -l` (from the kubelet's log file)."""
    meta = pod["metadata"]
    path = node.pod_logs_dir / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / container / "0.log"
    found: list[DeviceNode] = []
    deadline = time.monotonic() + 30
    while not found and time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                # CRI log format: "<time> stdout F <text>"
                text = line.split(" ", 3)[3] if line.count(" ") >= 3 else line
                m = _LS_DEVICE.match(text.strip())
                if m:
                    found.append(DeviceNode(m.group(3), int(m.group(1)), int(m.group(2))))
        if not found:
            time.sleep(0.1)  # the poll interval
    return found


def gpu_minors(devices: list[DeviceNode]) -> set[int]:
    """Minors of the per-GPU nodes (/dev/nvidiaN), not the control nodes."""
    return {d.minor for d in devices if re.fullmatch(r"/dev/nvidia\d+", d.path)}


def container_id(pod: JSON, container: str) -> str:
    status = next(s for s in pod["status"]["containerStatuses"] if s["name"] == container)
    return str(status["containerID"]).split("://", 1)[1]


def host_pid(node: Node, container: str) -> int:
    """Host PID of a container's first process (containerd reports it in the node's PID namespace)."""
    ns_pid = node.task_pids()[container]
    for pid in descendants(node.init_pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
        if len(nspid) >= 2 and int(nspid[1]) == ns_pid:
            return pid
    raise LookupError(f"no process with PID {ns_pid} in the sandbox of {node.name}")


def live_environment(node: Node, container: str) -> dict[str, str]:
    raw = Path(f"/proc/{host_pid(node, container)}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def live_devices(node: Node, container: str) -> list[DeviceNode]:
    """The container's /dev/nvidia* nodes now, read through its root (/proc/<pid>/root)."""
    dev = Path(f"/proc/{host_pid(node, container)}/root/dev")
    out: list[DeviceNode] = []
    for entry in sorted(dev.iterdir()):
        if entry.name.startswith("nvidia"):
            st = entry.lstat()
            out.append(DeviceNode(f"/dev/{entry.name}", os.major(st.st_rdev), os.minor(st.st_rdev)))
    return out


def cdi_specs_of(node: Node, uid: str) -> list[Path]:
    return [p for p in node.cdi_dir.iterdir() if p.is_file() and uid in p.read_text()]


def claims_released(api: client.ApiClient, namespace: str) -> bool:
    items = sync_request(api, "GET", f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims")["items"]
    return not any(c.get("status", {}).get("reservedFor") for c in items)
