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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from dra_driver.jsontypes import JSON
from tests.harness.bodies import claim_body, claim_pod
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


def cdi_edits(bench: Bench, cdi_ids: Sequence[str]) -> dict[str, Any]:
    """The OCI edits `cdicheck` (the CDI library containerd and CRI-O use) makes of the
    plugin's CDI ids."""
    out = subprocess.run(
        [str(bench.control_plane.bin_dir / "cdicheck"), "-dir", str(bench.plugin.cdi_dir), *cdi_ids],
        capture_output=True,
        text=True,
        check=True,
    )
    oci: dict[str, Any] = json.loads(out.stdout)
    return oci


class PinnedClaims:
    """Claims and pods of one test in its namespace, pinned to `node`; `clear()` (or leaving
    a `with` block) deletes them and waits until the claims are gone."""

    def __init__(self, api: client.ApiClient, namespace: str, node: str) -> None:
        self.api, self.ns, self.node = api, namespace, node
        self.counter = itertools.count()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.clear()

    def create(self, devices: JSON) -> str:
        """A claim of `devices` and a pod using it whole, both named cN."""
        name = f"c{next(self.counter)}"
        sync_request(self.api, "POST", f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims",
                     claim_body(name, devices))
        pod = claim_pod(name, {"resourceClaimName": name}, self.node)
        sync_request(self.api, "POST", f"/api/v1/namespaces/{self.ns}/pods", pod)
        return name

    def results(self, name: str) -> list[JSON]:
        """The pod is bound: the allocation results of its one claim."""

        def probe() -> JSON | None:
            pod = get_pod(self.api, self.ns, name)
            return pod if pod["spec"].get("nodeName") else None

        try:
            pod = wait_for(f"pod {name} bound", probe, timeout=30)
        except TimeoutError as e:
            raise AssertionError(f"{e}; scheduler says: {scheduler_reason(self.api, self.ns, name)}") from e
        ((claim, _),) = pod_claim_names(pod)
        return allocation_results(get_claim(self.api, self.ns, claim))

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

    def clear(self) -> None:
        now = {"gracePeriodSeconds": "0"}
        sync_request(self.api, "DELETE", f"/api/v1/namespaces/{self.ns}/pods", query=now)
        sync_request(self.api, "DELETE", f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims")

        def released() -> bool:
            claims = sync_request(self.api, "GET", f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims")
            return not claims["items"]

        wait_for("the case's claims to be gone", released, timeout=60)


class Case(PinnedClaims):
    """PinnedClaims on the bench's node, prepared through the kubelet's side; `clear()`
    unprepares what was prepared first."""

    def __init__(self, bench: Bench, namespace: str) -> None:
        super().__init__(bench.api, namespace, bench.node)
        self.bench = bench
        self.prepared: list[ClaimName] = []

    def bound(self, name: str) -> JSON:
        """The pod is bound: the one allocation result of its one claim."""
        (result,) = self.results(name)
        return result

    def prepare_claim(self, claim: JSON) -> Any:
        """NodePrepareResources for one claim as the kubelet sends it (v1): its answer."""
        ref = ClaimName(self.ns, claim["metadata"]["name"], claim["metadata"]["uid"])
        response = self.bench.kubelet.prepare(ref)
        self.prepared.append(ref)
        return response.claims[ref.uid]

    def prepare(self, name: str) -> tuple[Any, dict[str, Any]]:
        """The one device answered for claim `name` and the OCI edits of its CDI ids."""
        answer = self.prepare_claim(get_claim(self.api, self.ns, name))
        assert not answer.error, answer.error
        (device,) = answer.devices
        return device, cdi_edits(self.bench, device.cdi_device_ids)

    def clear(self) -> None:
        for ref in reversed(self.prepared):
            self.bench.kubelet.unprepare(ref)
        self.prepared.clear()
        super().clear()


def oci_env(oci: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in oci["process"]["env"])
