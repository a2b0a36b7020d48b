"""Claims and pods pinned to one plugin node, against the real kube-scheduler: each test's
claims are standalone ResourceClaims used by pods pinned to the node (so nothing lands
elsewhere or is landed on), bound, refused or prepared through the kubelet's side
(tests/harness/kubelet.py), every CDI id resolved by `cdicheck` (the CDI library containerd
and CRI-O use). Helpers only: the tests decide what is right.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from dra_driver.jsontypes import JSON
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DriverProcess
from tests.harness.kubelet import ClaimName, KubeletSide
from tests.harness.objects import (
    RESOURCE_API,
    allocation_results,
    get_claim,
    get_pod,
    pod_claim_names,
    scheduler_reason,
    sync_request,
    wait_for,
)


@dataclass
class Bench:
    api: client.ApiClient
    control_plane: ControlPlane
    plugin: DriverProcess
    kubelet: KubeletSide
    node: str


class Case:
    """Claims and pods of one test in its namespace, pinned to the node; `clear()` frees them."""

    def __init__(self, bench: Bench, namespace: str) -> None:
        self.bench, self.api, self.ns = bench, bench.api, namespace
        self.counter = itertools.count()
        self.prepared: list[ClaimName] = []

    def create(self, devices: JSON) -> str:
        name = f"c{next(self.counter)}"
        sync_request(
            self.api,
            "POST",
            f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name},
                "spec": {"devices": devices},
            },
        )
        sync_request(
            self.api,
            "POST",
            f"/api/v1/namespaces/{self.ns}/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": self.bench.node},
                    "automountServiceAccountToken": False,
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                    "containers": [
                        {
                            "name": "main",
                            "image": "busybox:1.37",
                            "command": ["sleep", "3600"],
                            "resources": {"claims": [{"name": "gpu"}]},
                        }
                    ],
                },
            },
        )
        return name

    def bound(self, name: str) -> JSON:
        """The pod is bound: the one allocation result of its one claim."""

        def probe() -> JSON | None:
            pod = get_pod(self.api, self.ns, name)
            return pod if pod["spec"].get("nodeName") else None

        try:
            pod = wait_for(f"pod {name} bound", probe, timeout=30)
        except TimeoutError as e:
            raise AssertionError(f"{e}; scheduler says: {scheduler_reason(self.api, self.ns, name)}") from e
        ((claim, _),) = pod_claim_names(pod)
        (result,) = allocation_results(get_claim(self.api, self.ns, claim))
        return result

    def pending(self, name: str) -> str:
        """The pod stays unbound: the scheduler's reason."""

        def probe() -> str | None:
            assert not get_pod(self.api, self.ns, name)["spec"].get("nodeName"), f"{name} was bound"
            return scheduler_reason(self.api, self.ns, name) or None

        reason = wait_for(f"a FailedScheduling event for {name}", probe, timeout=30)
        assert not allocation_results(get_claim(self.api, self.ns, name))
        return reason

    def delete(self, name: str) -> None:
        sync_request(
            self.api, "DELETE", f"/api/v1/namespaces/{self.ns}/pods/{name}", query={"gracePeriodSeconds": "0"}
        )
        sync_request(self.api, "DELETE", f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims/{name}")

        def gone() -> bool:
            try:
                get_claim(self.api, self.ns, name)
            except ApiException as e:
                return bool(e.status == 404)
            return False

        wait_for(f"claim {name} to be gone", gone, timeout=60)

    def prepare(self, name: str) -> tuple[Any, dict[str, Any]]:
        """NodePrepareResources as the kubelet sends it (v1); the device answered and the OCI
        edits cdicheck makes of its CDI ids."""
        claim = get_claim(self.api, self.ns, name)
        ref = ClaimName(self.ns, name, claim["metadata"]["uid"])
        response = self.bench.kubelet.prepare(ref)
        self.prepared.append(ref)
        answer = response.claims[ref.uid]
        assert not answer.error, answer.error
        (device,) = answer.devices
        out = subprocess.run(
            [
                str(self.bench.control_plane.bin_dir / "cdicheck"),
                "-dir",
                str(self.bench.plugin.cdi_dir),
                *device.cdi_device_ids,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        oci: dict[str, Any] = json.loads(out.stdout)
        return device, oci

    def clear(self) -> None:
        for ref in reversed(self.prepared):
            self.bench.kubelet.unprepare(ref)
        now = {"gracePeriodSeconds": "0"}
        sync_request(self.api, "DELETE", f"/api/v1/namespaces/{self.ns}/pods", query=now)
        sync_request(self.api, "DELETE", f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims")

        def released() -> bool:
            claims = sync_request(self.api, "GET", f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims")
            return not claims["items"]

        wait_for("the case's claims to be gone", released, timeout=60)


def oci_env(oci: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in oci["process"]["env"])
