"""Claim device status against a real kube-apiserver: the server-side apply the plugin sends
is accepted (schema, list-map keys, conditions), `kubectl describe resourceclaim` shows the
device's UUID, a health change flips Ready and back, Unprepare releases the entries, and a
service account without the status grant is refused, counted, and keeps the info series.
The pod-and-kubelet half of the story is in tests/node/test_claim_status.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from kubernetes import client

from dra_driver import DEFAULT_DRIVER_NAME, kube, metrics
from dra_driver.devices import node_devices
from dra_driver.gpu import discover
from dra_driver.health.effects import DeviceView
from dra_driver.plugin.claim_status import ClaimStatus, field_manager, nvlink_peers
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.prepared import PreparedDevice
from tests.harness.claims import allocated_claim
from tests.harness.cluster import ControlPlane
from tests.harness.objects import get_claim, sync_request


def _status(kubeconfig: Path, node: str) -> tuple[ClaimStatus, Any]:
    inventory = discover("hgx-h200")
    devices = node_devices(inventory)
    return ClaimStatus(None, DEFAULT_DRIVER_NAME, node, devices, nvlink_peers(inventory, devices),  # type: ignore[arg-type]
                       first_backoff=0.01), inventory


async def _with_client(status: ClaimStatus, kubeconfig: Path) -> None:
    status.api = await kube.load_client(str(kubeconfig))


def _ready(claim: dict[str, Any]) -> list[tuple[str, str]]:
    return [(d["device"], c["status"]) for d in claim["status"].get("devices", []) for c in d["conditions"]
            if c["type"] == "Ready"]


def test_status_devices_written_described_flipped_and_released(
    control_plane: ControlPlane, api: client.ApiClient, namespace: str, unique: str
) -> None:
    node = f"node-{unique}"
    claim = allocated_claim(api, namespace, "train", [{"pool": node, "device": "gpu-4"}], "gpu")
    ref = ClaimRef(namespace, "train", claim["metadata"]["uid"])
    status, inventory = _status(control_plane.kubeconfig, node)
    gpu4 = inventory.gpu(4)

    async def prepare_then_sicken() -> None:
        await _with_client(status, control_plane.kubeconfig)
        try:
            status.prepared(ref, [PreparedDevice(("gpu",), node, "gpu-4", ())])
            await status.settled()
            written = get_claim(api, namespace, "train")
            assert _ready(written) == [("gpu-4", "True")]
            [entry] = written["status"]["devices"]
            assert entry["data"]["uuid"] == gpu4.uuid and entry["data"]["pciBusID"] == gpu4.pci_bus_id
            managers = {(m["manager"], m.get("subresource")) for m in written["metadata"]["managedFields"]}
            assert (field_manager(DEFAULT_DRIVER_NAME, node), "status") in managers

            described = control_plane.kubectl("describe", "resourceclaim", "-n", namespace, "train").stdout
            print(f"\n{described}")
            assert gpu4.uuid in described and gpu4.pci_bus_id in described, described

            status.health({"gpu-4": DeviceView(False, "XID 79: GPU has fallen off the bus")})
            await status.settled()
            sick = get_claim(api, namespace, "train")
            assert _ready(sick) == [("gpu-4", "False")]
            assert "fallen off the bus" in sick["status"]["devices"][0]["conditions"][0]["message"]

            status.health({"gpu-4": DeviceView(True, "")})
            await status.settled()
            assert _ready(get_claim(api, namespace, "train")) == [("gpu-4", "True")]

            status.unprepared(ref)
            await status.settled()
            assert get_claim(api, namespace, "train")["status"].get("devices", []) == []
        finally:
            await status.stop()
            await status.api.close()

    asyncio.run(prepare_then_sicken())


def test_refused_status_write_is_counted_and_the_info_series_stays(
    control_plane: ControlPlane, api: client.ApiClient, namespace: str, unique: str, tmp_path: Path
) -> None:
    node = f"node-{unique}"
    claim = allocated_claim(api, namespace, "infer", [{"pool": node, "device": "gpu-1"}], "gpu")
    ref = ClaimRef(namespace, "infer", claim["metadata"]["uid"])
    # A plugin whose role lost the status grant: it may read claims, nothing more.
    sync_request(api, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
                 {"metadata": {"name": "plugin"}})
    sync_request(api, "POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles", {
        "metadata": {"name": "read-claims"},
        "rules": [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]}],
    })
    sync_request(api, "POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings", {
        "metadata": {"name": "read-claims"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-claims"},
        "subjects": [{"kind": "ServiceAccount", "name": "plugin", "namespace": namespace}],
    })
    token = sync_request(api, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/plugin/token",
                         {"spec": {"expirationSeconds": 3600}})["status"]["token"]
    kubeconfig = tmp_path / "plugin.kubeconfig"
    control_plane.write_kubeconfig(kubeconfig, "plugin", token)
    status, inventory = _status(kubeconfig, node)

    def refused() -> float:
        value = metrics.REGISTRY.get_sample_value(
            "gpu_dra_api_errors_total", {"component": "claim-status", "code": "403"})
        return value or 0.0

    before = refused()

    async def prepare() -> list[str]:
        await _with_client(status, kubeconfig)
        try:
            status.prepared(ref, [PreparedDevice(("gpu",), node, "gpu-1", ())])
            await status.settled()
            return [s.labels["uuid"] for m in metrics.REGISTRY.collect()
                    if m.name == "gpu_dra_device_claim_info" for s in m.samples
                    if s.labels["claim_uid"] == ref.uid]
        finally:
            await status.stop()
            await status.api.close()

    assert asyncio.run(prepare()) == [inventory.gpu(1).uuid]
    assert refused() > before
    assert get_claim(api, namespace, "infer")["status"].get("devices", []) == []
