"""The claim device status writer and the info series, against a scripted API server:
what is applied (server-side apply body, field manager), when (Prepare, health change,
Unprepare), and that an API error is retried and counted but never fails the Prepare."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver import kube, metrics
from dra_driver.devices import node_devices
from dra_driver.gpu import discover
from dra_driver.health.effects import DeviceView
from dra_driver.plugin import claim_status
from dra_driver.plugin.claim_status import (
    MAX_FIELD_MANAGER,
    ClaimStatus,
    ReportingPreparer,
    field_manager,
    nvlink_peers,
)
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.prepared import PreparedDevice
from dra_driver.plugin.state import ClaimResult
from dra_driver.sharing.shares import share_views

NODE = "node-a"
REF = ClaimRef("team", "train", "11111111-2222-3333-4444-555555555555")


def claim_json(
    ref: ClaimRef, pods: Sequence[str], results: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
        "status": {
            "allocation": {"devices": {"results": results or []}},
            "reservedFor": [{"resource": "pods", "name": p, "uid": f"uid-{p}"} for p in pods],
        },
    }


class FakeApi:
    """kube.request, scripted: GETs answer the claim, PATCHes are recorded (or refused)."""

    def __init__(self, claim: dict[str, Any], refuse_patch: int | None = None) -> None:
        self.claim = claim
        self.refuse_patch = refuse_patch
        self.patches: list[dict[str, Any]] = []
        self.calls: list[str] = []

    async def request(self, api: object, method: str, path: str, body: Any = None,
                      query: dict[str, str] | None = None, content_type: str = "application/json",
                      timeout: float = 30.0) -> dict[str, Any]:
        self.calls.append(f"{method} {path}")
        if method == "GET":
            return self.claim
        assert method == "PATCH" and path.endswith("/status"), path
        if self.refuse_patch is not None:
            raise kube.ApiException(self.refuse_patch, "Forbidden", "resourceclaims/status is forbidden")
        self.patches.append({"body": body, "query": query, "content_type": content_type})
        return self.claim


@pytest.fixture
def h200() -> tuple[Any, dict[str, Any]]:
    inventory = discover("hgx-h200")
    devices = node_devices(inventory)
    devices.update(share_views(devices))
    return inventory, devices


def writer(h200: tuple[Any, dict[str, Any]]) -> ClaimStatus:
    inventory, devices = h200
    return ClaimStatus(object(), DRIVER, NODE, devices, nvlink_peers(inventory, devices), first_backoff=0.001)  # type: ignore[arg-type]


def info_series() -> list[dict[str, str]]:
    return [s.labels for m in metrics.REGISTRY.collect() if m.name == "gpu_dra_device_claim_info"
            for s in m.samples]


def api_errors(code: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "gpu_dra_api_errors_total", {"component": "claim-status", "code": code})
    return value or 0.0


class Inner:
    def __init__(self, results: dict[str, ClaimResult]) -> None:
        self.results = results

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        return self.results

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        return {r.uid: ClaimResult() for r in refs}


def test_prepare_applies_device_status_and_info_series_until_unprepare(
    h200: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    inventory, _ = h200
    fake = FakeApi(claim_json(REF, ["trainer-0"]))
    monkeypatch.setattr(kube, "request", fake.request)
    status = writer(h200)
    prepared = (PreparedDevice(("gpu",), NODE, "gpu-3", ("k8s.gpu.dra-driver.dev/claim=x-gpu-3",)),
                PreparedDevice(("gpu",), "other-node", "gpu-1", ()))
    reporting = ReportingPreparer(Inner({REF.uid: ClaimResult(prepared)}), status)

    async def scenario() -> None:
        results = await reporting.prepare([REF])
        assert results[REF.uid].error is None
        await status.settled()
        gpu3 = inventory.gpu(3)
        assert info_series() == [{
            "device": "gpu-3", "uuid": gpu3.uuid, "pci_bus_id": gpu3.pci_bus_id, "claim_namespace": "team",
            "claim_name": "train", "claim_uid": REF.uid, "pod_namespace": "team", "pod_name": "trainer-0",
        }]
        [patch] = fake.patches
        assert patch["content_type"] == "application/apply-patch+yaml"
        assert patch["query"] == {"fieldManager": f"{DRIVER}/{NODE}", "force": "true"}
        body = patch["body"]
        assert body["metadata"] == {"namespace": "team", "name": "train", "uid": REF.uid}
        [entry] = body["status"]["devices"]  # the other pool's device is not this node's to write
        assert (entry["driver"], entry["pool"], entry["device"]) == (DRIVER, NODE, "gpu-3")
        assert [(c["type"], c["status"]) for c in entry["conditions"]] == [("Ready", "True")]
        data = entry["data"]
        assert (data["uuid"], data["pciBusID"], data["minor"]) == (gpu3.uuid, gpu3.pci_bus_id, gpu3.minor)
        assert data["product"] == gpu3.product_name
        assert {p["gpu"] for p in data["nvlinkPeers"]} == {f"gpu-{i}" for i in range(8) if i != 3}
        assert "shareID" not in entry and "mig" not in data

        await reporting.unprepare([REF])
        await status.settled()
        assert info_series() == []
        assert fake.patches[-1]["body"]["status"] == {"devices": []}

    asyncio.run(scenario())


def test_health_flips_ready_and_back(
    h200: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeApi(claim_json(REF, ["p"]))
    monkeypatch.setattr(kube, "request", fake.request)
    status = writer(h200)

    async def scenario() -> list[tuple[str, str, str]]:
        status.prepared(REF, [PreparedDevice(("gpu",), NODE, "gpu-0", ())])
        await status.settled()
        status.health({"gpu-0": DeviceView(False, "XID 79: GPU has fallen off the bus"),
                       "gpu-5": DeviceView(True, "")})
        await status.settled()
        status.health({"gpu-0": DeviceView(True, ""), "gpu-5": DeviceView(False, "XID 48")})
        await status.settled()  # gpu-5 is not this claim's: no write for it
        status.unprepared(REF)
        await status.settled()
        conditions = [p["body"]["status"]["devices"][0]["conditions"][0] for p in fake.patches[:-1]]
        return [(c["status"], c["reason"], c["message"]) for c in conditions]

    seen = asyncio.run(scenario())
    assert [s[:2] for s in seen] == [("True", "Prepared"), ("False", "DeviceUnhealthy"), ("True", "Prepared")]
    assert "fallen off the bus" in seen[1][2]
    assert info_series() == []


def test_refused_write_is_retried_counted_and_never_fails_prepare(
    h200: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeApi(claim_json(REF, ["p"]), refuse_patch=403)
    monkeypatch.setattr(kube, "request", fake.request)
    status = writer(h200)
    prepared = (PreparedDevice(("gpu",), NODE, "gpu-2", ()),)
    reporting = ReportingPreparer(Inner({REF.uid: ClaimResult(prepared)}), status)
    before = api_errors("403")

    async def scenario() -> ClaimResult:
        result = (await reporting.prepare([REF]))[REF.uid]
        await status.settled()
        return result

    assert asyncio.run(scenario()).error is None
    assert api_errors("403") - before == claim_status.ATTEMPTS
    assert fake.patches == []
    assert [s["device"] for s in info_series()] == ["gpu-2"]  # the series does not need the write
    metrics.device_claim_info.clear()


def test_gone_claim_is_not_retried(h200: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeApi(claim_json(REF, []), refuse_patch=404)
    monkeypatch.setattr(kube, "request", fake.request)
    status = writer(h200)
    before = api_errors("404")

    async def scenario() -> None:
        status.unprepared(REF)
        await status.settled()

    asyncio.run(scenario())
    assert api_errors("404") - before == 1
    assert fake.calls == ["PATCH /apis/resource.k8s.io/v1/namespaces/team/resourceclaims/train/status"]


def test_share_entry_carries_share_id_and_consumed_memory(
    h200: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    share = "0a4f6a36-8a5e-4d2c-9a4b-3c1b2b3f7e11"
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-1-share", "shareID": share,
              "consumedCapacity": {"memory": "16Gi"}}
    fake = FakeApi(claim_json(REF, ["a", "b"], [result]))
    monkeypatch.setattr(kube, "request", fake.request)
    status = writer(h200)

    async def scenario() -> None:
        status.prepared(REF, [PreparedDevice(("gpu",), NODE, "gpu-1-share", (), share_id=share)])
        await status.settled()

    asyncio.run(scenario())
    [entry] = fake.patches[0]["body"]["status"]["devices"]
    assert entry["shareID"] == share
    assert entry["data"]["share"] == {"shareID": share, "consumedCapacity": {"memory": "16Gi"}}
    assert sorted(s["pod_name"] for s in info_series()) == ["a", "b"]
    metrics.device_claim_info.clear()


def test_mig_entry_names_the_instance_and_its_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    inventory = discover("a100-mig")
    devices = node_devices(inventory)
    name, mig_device = next((n, d) for n, d in devices.items() if d.mig is not None)
    fake = FakeApi(claim_json(REF, ["p"]))
    monkeypatch.setattr(kube, "request", fake.request)
    status = ClaimStatus(object(), DRIVER, NODE, devices, nvlink_peers(inventory, devices))  # type: ignore[arg-type]

    async def scenario() -> None:
        status.prepared(REF, [PreparedDevice(("gpu",), NODE, name, ())])
        await status.settled()

    asyncio.run(scenario())
    data = fake.patches[0]["body"]["status"]["devices"][0]["data"]
    assert mig_device.mig is not None
    assert data["uuid"] == mig_device.mig.uuid
    assert data["mig"]["parentUUID"] == mig_device.gpu.uuid
    assert data["mig"]["profile"] == mig_device.mig.profile
    assert [s["uuid"] for s in info_series()] == [mig_device.mig.uuid]
    metrics.device_claim_info.clear()


def test_field_manager_fits_the_api_limit_and_keeps_long_names_apart() -> None:
    assert field_manager(DRIVER, NODE) == f"{DRIVER}/{NODE}"
    a, b = field_manager(DRIVER, "n" * 200 + "a"), field_manager(DRIVER, "n" * 200 + "b")
    assert len(a) <= MAX_FIELD_MANAGER and len(b) <= MAX_FIELD_MANAGER and a != b
