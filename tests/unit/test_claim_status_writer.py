"""The claim device status queue and the info series, against a scripted API server:
what is applied (server-side apply body, field manager), when (Prepare, health change,
Unprepare), that an API error is retried and counted but never fails the Prepare, and the
queue's shape: the claim Prepare read is reused (one GET per Prepare, through the real
gRPC service and preparer), states coalesce per claim, writes are bounded in number and
never start while a kubelet call is in flight, a gone claim ends its writes."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog.testing

from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver import kube, metrics
from dra_driver.devices import node_devices
from dra_driver.driver_root import simulated_driver_files
from dra_driver.gpu import discover
from dra_driver.health.effects import DeviceView
from dra_driver.kubeletapi.dra.v1 import api_pb2 as dra_v1
from dra_driver.kubeletapi.dra.v1 import api_pb2_grpc as dra_v1_grpc
from dra_driver.plugin import claim_status
from dra_driver.plugin.claim_source import ClaimReader
from dra_driver.plugin.claim_status import (
    MAX_FIELD_MANAGER,
    ClaimStatus,
    field_manager,
    nvlink_peers,
)
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.prepared import PreparedDevice
from dra_driver.plugin.server import SocketServer
from dra_driver.plugin.service import add_dra_services
from dra_driver.plugin.state import NodePreparer
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.policy import Sharing
from dra_driver.sharing.shares import share_views
from tests.harness.claims_in_memory import with_spec
from tests.harness.objects import watch_for_async

NODE = "node-a"
REF = ClaimRef("team", "train", "11111111-2222-3333-4444-555555555555")


def claim_json(
    ref: ClaimRef, pods: Sequence[str], results: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return with_spec({
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
        "status": {
            "allocation": {"devices": {"results": results or []}},
            "reservedFor": [{"resource": "pods", "name": p, "uid": f"uid-{p}"} for p in pods],
        },
    })


class FakeApi:
    """kube.request, scripted: GETs answer the claim, PATCHes are recorded (or refused)."""

    def __init__(self, claim: dict[str, Any], refuse_patch: int | None = None) -> None:
        self.claim = claim
        self.refuse_patch = refuse_patch
        self.patches: list[dict[str, Any]] = []
        self.calls: list[str] = []

    async def request(self, api: object, method: str, path: str, body: Any = None,
                      query: dict[str, str] | None = None, content_type: str = "application/json",
                      timeout: float = 30.0, attempts: int = kube.ATTEMPTS) -> dict[str, Any]:
        self.calls.append(f"{method} {path}")
        if method == "GET":
            return self.claim
        # the queue is the one retry layer of a status write: kube.request must not retry too
        assert attempts == 1
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


def writer(h200: tuple[Any, dict[str, Any]], **timing: float) -> ClaimStatus:
    """A writer with a short first backoff; `timing`: its other times (quiet_period, ...)."""
    inventory, devices = h200
    return ClaimStatus(object(), DRIVER, NODE, devices, nvlink_peers(inventory, devices),  # type: ignore[arg-type]
                       **{"first_backoff": 0.001, **timing})


def info_series() -> list[dict[str, str]]:
    return [s.labels for m in metrics.REGISTRY.collect() if m.name == "gpu_dra_device_claim_info"
            for s in m.samples]


def api_errors(code: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "gpu_dra_api_errors_total", {"component": "claim-status", "code": code})
    return value or 0.0


def test_prepare_applies_device_status_and_info_series_until_unprepare(
    h200: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    inventory, _ = h200
    fake = FakeApi(claim_json(REF, ["trainer-0"]))
    monkeypatch.setattr(kube, "request", fake.request)
    status = writer(h200)
    prepared = (PreparedDevice(("gpu",), NODE, "gpu-3", ("k8s.gpu.dra-driver.dev/claim=x-gpu-3",)),
                PreparedDevice(("gpu",), "other-node", "gpu-1", ()))

    async def scenario() -> None:
        status.prepared(REF, prepared, fake.claim)
        await status.settled()
        assert fake.calls == ["PATCH /apis/resource.k8s.io/v1/namespaces/team/resourceclaims/train/status"]
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

        status.unprepared(REF)
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
    before = api_errors("403")

    async def scenario() -> None:
        status.prepared(REF, prepared, fake.claim)  # returns at once: nothing to fail
        await status.settled()

    asyncio.run(scenario())
    assert api_errors("403") - before == claim_status.ATTEMPTS
    assert len(fake.calls) == claim_status.ATTEMPTS  # one retry layer: the queue's
    assert fake.patches == []
    assert [s["device"] for s in info_series()] == ["gpu-2"]  # the series does not need the write
    metrics.device_claim_info.clear()


def test_gone_claim_is_not_retried_and_is_no_error(
    h200: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim made from a template goes with its pod: the release's 404 is the expected end,
    not an error an operator's dashboard should count (it tracked the cluster's churn)."""
    fake = FakeApi(claim_json(REF, []), refuse_patch=404)
    monkeypatch.setattr(kube, "request", fake.request)
    status = writer(h200)
    before = api_errors("404")

    async def scenario() -> None:
        status.unprepared(REF)
        await status.settled()

    with structlog.testing.capture_logs() as logs:
        asyncio.run(scenario())
    assert api_errors("404") - before == 0
    assert not [e for e in logs if e["log_level"] in ("warning", "error")], logs
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


# --------------------------------------------------------------------------- the queue's shape


class ScriptedApi:
    """kube.request for many claims: GET answers the named claim, PATCH answers in turn the
    statuses in `errors` (then succeeds), and waits for `gate` if one is set. It records what
    the queue's writes overlap with: other writes, and kubelet calls in flight."""

    def __init__(self, claims: dict[str, dict[str, Any]], errors: Sequence[int] = ()) -> None:
        self.claims = claims
        self.errors = list(errors)
        self.retry_after: float | None = None  # what a 429 says
        self.calls: list[str] = []
        self.bodies: list[dict[str, Any]] = []
        self.gate: asyncio.Event | None = None
        self.writing = 0
        self.most_writing = 0
        self.status: ClaimStatus | None = None
        self.busy_seen: list[int] = []

    async def request(self, api: object, method: str, path: str, body: Any = None,
                      query: dict[str, str] | None = None, content_type: str = "application/json",
                      timeout: float = 30.0, attempts: int = kube.ATTEMPTS) -> dict[str, Any]:
        self.calls.append(f"{method} {path}")
        name = path.split("/resourceclaims/")[1].split("/")[0]
        if method == "GET":
            return self.claims[name]
        assert attempts == 1  # the queue is the one retry layer of a status write
        if self.status is not None:
            self.busy_seen.append(self.status._busy)
        self.writing += 1
        self.most_writing = max(self.most_writing, self.writing)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.errors:
                code = self.errors.pop(0)
                raise kube.ApiException(code, "scripted", "", self.retry_after if code == 429 else None)
            self.bodies.append(body)
            return self.claims[name]
        finally:
            self.writing -= 1


class QuietBoard:
    async def follow(self):  # type: ignore[no-untyped-def]
        await asyncio.Event().wait()
        yield ()


def patches_of(api: ScriptedApi) -> list[str]:
    return [c for c in api.calls if c.startswith("PATCH")]


async def within(deadline: float, condition: Any) -> None:
    """Wait until `condition()` holds; fail after `deadline` seconds."""
    async with asyncio.timeout(deadline):
        while not condition():
            await asyncio.sleep(0.001)


def test_prepare_through_grpc_reads_the_claim_once_and_writes_after_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real service, preparer and claim reader: each Prepare costs one GET (the status
    write reuses it) and one PATCH, written while no kubelet call is in flight."""
    inventory = discover("l4x4")
    devices = node_devices(inventory)
    refs = [ClaimRef("ns", f"c{i}", f"00000000-0000-0000-0000-00000000000{i}") for i in range(3)]
    claims = {r.name: with_spec({
        "metadata": {"namespace": r.namespace, "name": r.name, "uid": r.uid},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": f"gpu-{i}"}]}},
            "reservedFor": [{"resource": "pods", "name": f"pod-{i}", "uid": "p"}]},
    }) for i, r in enumerate(refs)}
    fake = ScriptedApi(claims)
    monkeypatch.setattr(kube, "request", fake.request)
    preparer = NodePreparer(
        driver=DRIVER, pool=NODE, devices=devices, claims=ClaimReader(object()),  # type: ignore[arg-type]
        driver_files=simulated_driver_files([g.minor for g in inventory.gpus]), cdi_dir=tmp_path / "cdi",
        state_dir=tmp_path / "state", boot_id="boot-1",
        sharing=Sharing(DRIVER, NODE, MpsControl(tmp_path / "mps", "/nonexistent-driver-root")),
    )
    status = ClaimStatus(object(), DRIVER, NODE, devices, nvlink_peers(inventory, devices),  # type: ignore[arg-type]
                         quiet_max_wait=60.0)
    fake.status = status

    async def scenario() -> None:
        (tmp_path / "state").mkdir()
        await preparer.recover()
        with tempfile.TemporaryDirectory(prefix="cst-") as directory:  # tmp_path can exceed 107 bytes
            socket = Path(directory) / "dra.sock"
            server = SocketServer("dra", lambda s: add_dra_services(s, preparer, QuietBoard(), status))  # type: ignore[arg-type]
            await server.start(socket)
            try:
                async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
                    stub = dra_v1_grpc.DRAPluginStub(channel)
                    for ref in refs:
                        claim = dra_v1.Claim(namespace=ref.namespace, name=ref.name, uid=ref.uid)
                        request = dra_v1.NodePrepareResourcesRequest(claims=[claim])
                        answer = await stub.NodePrepareResources(request)
                        assert not answer.claims[ref.uid].error, answer.claims[ref.uid].error
                async with asyncio.timeout(10):  # without grpc's done callbacks this waits 60 s
                    await status.settled()
            finally:
                await server.stop(None)
                await status.stop()

    asyncio.run(scenario())
    gets = [c for c in fake.calls if c.startswith("GET")]
    assert len(gets) == len(refs), fake.calls  # no second GET for the status
    assert len(patches_of(fake)) == len(refs)
    assert fake.busy_seen == [0] * len(refs)  # no write while a kubelet call was in flight
    pods = {b["metadata"]["name"]: b["status"]["devices"][0]["device"] for b in fake.bodies}
    assert pods == {"c0": "gpu-0", "c1": "gpu-1", "c2": "gpu-2"}
    metrics.device_claim_info.clear()


def test_states_of_one_claim_coalesce_and_the_latest_is_written(h200: tuple[Any, dict[str, Any]],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fake = ScriptedApi({"train": claim_json(REF, ["p"])})
    monkeypatch.setattr(kube, "request", fake.request)
    status = writer(h200)
    devices = [PreparedDevice(("gpu",), NODE, "gpu-0", ())]

    async def scenario() -> None:
        # prepared, sick, well again, sick: before any write began, so one write, the last state
        status.prepared(REF, devices, fake.claims["train"])
        status.health({"gpu-0": DeviceView(False, "XID 79")})
        status.health({"gpu-0": DeviceView(True, "")})
        status.health({"gpu-0": DeviceView(False, "XID 48: double bit ECC")})
        status.prepared(REF, devices, None)  # a kubelet retry: no new state
        await status.settled()
        assert len(patches_of(fake)) == 1
        [entry] = fake.bodies[0]["status"]["devices"]
        assert entry["conditions"][0]["status"] == "False" and "XID 48" in entry["conditions"][0]["message"]

        # prepared and unprepared before the write began: nothing to write, nothing to release
        other = ClaimRef("team", "brief", "99999999-2222-3333-4444-555555555555")
        fake.claims["brief"] = claim_json(other, ["q"])
        status.prepared(other, devices, fake.claims["brief"])
        status.unprepared(other)
        await status.settled()
        assert len(fake.calls) == 1, fake.calls

        status.unprepared(REF)  # written before: released once
        await status.settled()
        assert len(fake.calls) == 2 and fake.bodies[-1]["status"] == {"devices": []}

    asyncio.run(scenario())
    assert info_series() == []


def test_writes_are_bounded_in_number(
    h200: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    inventory, devices = h200
    refs = [ClaimRef("team", f"c{i}", f"{i:08d}-2222-3333-4444-555555555555") for i in range(8)]
    fake = ScriptedApi({r.name: claim_json(r, ["p"]) for r in refs})
    monkeypatch.setattr(kube, "request", fake.request)
    status = ClaimStatus(object(), DRIVER, NODE, devices, nvlink_peers(inventory, devices),  # type: ignore[arg-type]
                         concurrency=3)

    async def scenario() -> None:
        fake.gate = asyncio.Event()
        for i, ref in enumerate(refs):
            status.prepared(ref, [PreparedDevice(("gpu",), NODE, f"gpu-{i}", ())], fake.claims[ref.name])
        await within(10, lambda: fake.writing == 3)
        for _ in range(20):  # give a fourth write every chance to start
            await asyncio.sleep(0)
        assert fake.writing == 3
        fake.gate.set()
        await status.settled()
        await status.stop()

    asyncio.run(scenario())
    assert fake.most_writing == 3
    assert sorted(b["metadata"]["name"] for b in fake.bodies) == [r.name for r in refs]
    metrics.device_claim_info.clear()


def test_failed_write_is_retried_until_it_lands(h200: tuple[Any, dict[str, Any]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fake = ScriptedApi({"train": claim_json(REF, ["p"])}, errors=[500, 429])
    monkeypatch.setattr(kube, "request", fake.request)
    status = writer(h200)
    before = api_errors("500") + api_errors("429")

    async def scenario() -> None:
        status.prepared(REF, [PreparedDevice(("gpu",), NODE, "gpu-6", ())], fake.claims["train"])
        await status.settled()

    asyncio.run(scenario())
    assert len(patches_of(fake)) == 3 and len(fake.bodies) == 1
    assert fake.bodies[0]["status"]["devices"][0]["device"] == "gpu-6"
    assert api_errors("500") + api_errors("429") - before == 2
    metrics.device_claim_info.clear()


def test_a_429_is_retried_after_its_retry_after(h200: tuple[Any, dict[str, Any]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue is the one retry layer, so it waits what the API server asked for."""
    fake = ScriptedApi({"train": claim_json(REF, ["p"])}, errors=[429])
    fake.retry_after = 0.5
    monkeypatch.setattr(kube, "request", fake.request)
    status = writer(h200)

    async def scenario() -> float:
        status.prepared(REF, [PreparedDevice(("gpu",), NODE, "gpu-6", ())], fake.claims["train"])
        started = time.monotonic()
        await status.settled()
        return time.monotonic() - started

    waited = asyncio.run(scenario())
    assert len(patches_of(fake)) == 2 and len(fake.bodies) == 1
    assert waited >= 0.45  # the first backoff alone is 0.001 s
    metrics.device_claim_info.clear()


def test_deleted_claim_ends_its_writes(
    h200: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim deleted after its Prepare: the write's 404 ends it (no retry), and so does the
    release's after its Unprepare."""
    fake = ScriptedApi({"train": claim_json(REF, ["p"])}, errors=[404, 404])
    monkeypatch.setattr(kube, "request", fake.request)
    status = writer(h200)

    async def scenario() -> None:
        status.prepared(REF, [PreparedDevice(("gpu",), NODE, "gpu-1", ())], fake.claims["train"])
        await status.settled()
        assert len(fake.calls) == 1
        status.unprepared(REF)
        await status.settled()

    asyncio.run(scenario())
    assert len(fake.calls) == 2 and fake.bodies == []
    assert info_series() == []


def test_no_write_starts_while_a_kubelet_call_is_in_flight(h200: tuple[Any, dict[str, Any]],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    fake = ScriptedApi({"train": claim_json(REF, ["p"])})
    monkeypatch.setattr(kube, "request", fake.request)
    status = writer(h200, quiet_max_wait=60.0)

    async def scenario() -> None:
        status.call_started()
        status.prepared(REF, [PreparedDevice(("gpu",), NODE, "gpu-2", ())], fake.claims["train"])
        for _ in range(20):  # every chance to start
            await asyncio.sleep(0)
        assert fake.calls == []
        status.call_ended()
        async with asyncio.timeout(10):
            await status.settled()

    asyncio.run(scenario())
    assert len(fake.calls) == 1
    metrics.device_claim_info.clear()


def test_writes_wait_for_a_quiet_period_and_a_claim_gone_within_it_is_never_written(
        h200: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The kubelet's calls come in bursts: no write starts within `quiet_period` of a call's
    end, and a claim prepared and unprepared within the burst costs the API server nothing."""
    fake = ScriptedApi({"train": claim_json(REF, ["p"])})
    monkeypatch.setattr(kube, "request", fake.request)
    status = writer(h200, quiet_max_wait=60.0, quiet_period=0.3)
    device = [PreparedDevice(("gpu",), NODE, "gpu-2", ())]

    def call(report: Callable[[], None]) -> None:
        status.call_started()
        report()
        status.call_ended()

    async def scenario() -> None:
        call(lambda: status.prepared(REF, device, fake.claims["train"]))
        written = await watch_for_async(lambda: fake.calls, 0.1)
        assert not written, "nothing within the quiet period"
        call(lambda: status.unprepared(REF))
        async with asyncio.timeout(10):
            await status.settled()
        assert fake.calls == []  # prepared and unprepared before its write: nothing to write
        call(lambda: status.prepared(REF, device, fake.claims["train"]))
        started = time.monotonic()
        async with asyncio.timeout(10):
            await status.settled()
        assert len(fake.calls) == 1 and time.monotonic() - started >= 0.25

    asyncio.run(scenario())
    metrics.device_claim_info.clear()


def test_stop_makes_the_writes_wanted_so_far_within_its_flush(
        h200: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A Prepare answered just before the plugin stops still gets its status: the quiet
    period ends at stop, not the write."""
    fake = ScriptedApi({"train": claim_json(REF, ["p"])})
    monkeypatch.setattr(kube, "request", fake.request)
    status = writer(h200, quiet_period=0.3)

    async def scenario() -> None:
        status.call_started()
        status.prepared(REF, [PreparedDevice(("gpu",), NODE, "gpu-2", ())], fake.claims["train"])
        status.call_ended()
        await status.stop(flush=5.0)

    asyncio.run(scenario())
    assert len(fake.calls) == 1 and fake.bodies[0]["status"]["devices"][0]["device"] == "gpu-2"
    metrics.device_claim_info.clear()


def test_the_info_series_fields_are_the_metric_labels_in_order() -> None:
    """ClaimStatus passes an InfoLabels to the metric positionally."""
    from dra_driver.plugin.device_status import InfoLabels

    assert InfoLabels._fields == tuple(metrics.device_claim_info._labelnames)
