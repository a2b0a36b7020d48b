"""`dra-driver status` / `kubectl gpu`: the view built from API objects (slices as the
controller publishes them, claims as the scheduler allocates them), its text and JSON, the
error for an unknown node, and the progress line of a paged read."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from typing import Any

import pytest

from controller.slices import SliceFeatures, desired_slices
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver import kube
from dra_driver.commands.status import StatusError, node_view, read_node, render
from dra_driver.gpu import discover

NODE = "node-a"


def slices(profile: str, taints: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    specs = desired_slices(discover(profile), NODE, DRIVER, SliceFeatures(memory_shares=True))
    out = [{"metadata": {"name": f"s{i}"}, "spec": spec} for i, spec in enumerate(specs)]
    for s in out:
        for d in s["spec"].get("devices") or []:
            if taints and d["name"] in taints:
                d["taints"] = [taints[d["name"]]]
    return out


def claim(name: str, uid: str, results: list[dict[str, Any]], pods: list[tuple[str, str]],
          devices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "team", "name": name, "uid": uid},
        "status": {
            "allocation": {"devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, **r}
                                                   for r in results]}},
            "reservedFor": [{"resource": "pods", "name": p, "uid": u} for p, u in pods],
            "devices": devices or [],
        },
    }


def pod(name: str, uid: str, phase: str) -> dict[str, Any]:
    return {"metadata": {"namespace": "team", "name": name, "uid": uid}, "status": {"phase": phase}}


SHARE = "0a4f6a36-8a5e-4d2c-9a4b-3c1b2b3f7e11"


def h200_view() -> Any:
    claims = [
        claim("train", "c1", [{"device": "gpu-3"}], [("trainer", "p1")],
              [{"driver": DRIVER, "pool": NODE, "device": "gpu-3",
                "conditions": [{"type": "Ready", "status": "True", "reason": "Prepared"}]}]),
        claim("small", "c2",
              [{"device": "gpu-1-share", "shareID": SHARE, "consumedCapacity": {"memory": "16Gi"}}],
              [("infer-a", "p2"), ("infer-b", "p3")]),
        claim("elsewhere", "c3", [{"device": "gpu-0", "pool": "node-b"}], [("x", "p4")]),
        {"metadata": {"namespace": "team", "name": "pending", "uid": "c4"}, "status": {}},
    ]
    pods = [pod("trainer", "p1", "Running"), pod("infer-a", "p2", "Running"), pod("infer-b", "p3", "Pending")]
    taint = {"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}
    return node_view(NODE, DRIVER, slices("hgx-h200", {"gpu-5": taint}), claims, pods)


def test_whole_gpus_and_shares_show_their_claims_pods_and_readiness() -> None:
    view = h200_view()
    assert [g.name for g in view.gpus] == [f"gpu-{i}" for i in range(8)]
    gpus = {g.name: g for g in view.gpus}
    devices = {d.name: d for g in view.gpus for d in g.devices}
    [train] = devices["gpu-3"].holders
    assert (train.claim_name, train.pods, train.ready) == ("train", ("team/trainer (Running)",), "True")
    [small] = devices["gpu-1-share"].holders
    assert small.memory == "16Gi" and small.share_id == SHARE
    assert small.pods == ("team/infer-a (Running)", "team/infer-b (Pending)")
    assert devices["gpu-0"].holders == ()  # the same device name in another node's pool
    assert gpus["gpu-5"].health == "Unhealthy" and gpus["gpu-5"].taints == (f"{DRIVER}/xid=79:NoSchedule",)
    assert gpus["gpu-2"].health == "Healthy" and gpus["gpu-2"].product == "NVIDIA H200"
    assert gpus["gpu-0"].nvlink_peers == (1, 2, 3, 4, 5, 6, 7)
    assert gpus["gpu-3"].uuid == devices["gpu-3"].uuid == discover("hgx-h200").gpu(3).uuid

    text = render(view)
    assert "NVLink" in text
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("gpu-1-share") and "team/small" in line)
    assert "16Gi of" in row and "team/infer-a (Running)" in row
    assert not any(line.startswith("gpu-2-share") for line in lines)  # a free share view is its GPU
    gpu5 = next(line for line in lines if line.startswith("gpu-5 ") and "Unhealthy" in line)
    assert "xid=79" in gpu5
    as_json = json.loads(json.dumps(asdict(view)))
    assert as_json["gpus"][3]["devices"][0]["holders"][0]["claim_name"] == "train"


@pytest.mark.parametrize("features", [SliceFeatures(), SliceFeatures(memory_shares=True)],
                         ids=["whole", "shares"])
def test_an_admin_access_claim_holds_no_device(features: SliceFeatures) -> None:
    """A monitoring claim with adminAccess on every GPU (allocationMode All): the scheduler
    still gives those GPUs to other claims, so they are free; the one a pod holds is held."""
    specs = desired_slices(discover("l4x4"), NODE, DRIVER, features)
    node_slices = [{"metadata": {"name": f"s{i}"}, "spec": spec} for i, spec in enumerate(specs)]
    monitor = claim("monitor", "c-mon", [{"device": f"gpu-{i}", "adminAccess": True} for i in range(4)],
                    [("dcgm", "p-mon")])
    train = claim("train", "c-train", [{"device": "gpu-2"}], [("trainer", "p-train")])
    view = node_view(NODE, DRIVER, node_slices, [monitor, train],
                     [pod("dcgm", "p-mon", "Running"), pod("trainer", "p-train", "Running")])
    devices = {d.name: d for g in view.gpus for d in g.devices}
    assert [h.admin_access for h in devices["gpu-0"].holders] == [True]
    text = render(view)
    devices_table = text[text.index("\nDEVICE "):].splitlines()
    rows = [line for line in devices_table if line.startswith(("gpu-0 ", "gpu-2 "))]
    free0 = [r for r in rows if r.startswith("gpu-0 ")]
    assert len(free0) == 1 and "free, admin access" in free0[0] and "team/monitor" in free0[0], rows
    held2 = [r for r in rows if r.startswith("gpu-2 ") and "team/train" in r]
    assert len(held2) == 1 and " held " in held2[0], rows
    assert not any(" held " in r for r in rows if r.startswith("gpu-0 ")), rows


def test_mig_instances_are_listed_under_their_gpu() -> None:
    inventory = discover("a100-mig")
    mig_slices = slices("a100-mig")
    mig = next(d for s in mig_slices for d in s["spec"].get("devices") or [] if "-mig-" in d["name"])
    view = node_view(NODE, DRIVER, mig_slices,
                     [claim("m", "c9", [{"device": mig["name"]}], [("mig-pod", "p9")])],
                     [pod("mig-pod", "p9", "Running")])
    parent = next(g for g in view.gpus if any(d.name == mig["name"] for d in g.devices))
    assert parent.memory == "MIG mode"
    assert parent.uuid == inventory.gpu(parent.index).uuid
    [row] = [d for d in parent.devices if d.name == mig["name"]]
    assert row.kind == "mig" and row.holders[0].pods == ("team/mig-pod (Running)",)
    assert row.uuid.startswith("MIG-")


class ScriptedApi:
    def __init__(self, node_exists: bool, claim_pages: int = 1) -> None:
        self.node_exists = node_exists
        self.claim_pages = claim_pages

    async def request(self, api: object, method: str, path: str, body: Any = None,
                      query: dict[str, str] | None = None, **_: Any) -> dict[str, Any]:
        query = query or {}
        if path.startswith("/api/v1/nodes/"):
            if not self.node_exists:
                raise kube.ApiException(404, "Not Found", "nodes not found")
            return {}
        if path.endswith("/resourceslices"):
            if "spec.nodeName" in query.get("fieldSelector", ""):
                return {"items": slices("l4x4")}
            return {"items": [{"spec": {"nodeName": "gpu-node-1"}}, {"spec": {"nodeName": "gpu-node-2"}}]}
        if path.endswith("/resourceclaims"):
            page = int(query.get("continue", "0"))
            more = {"continue": str(page + 1)} if page + 1 < self.claim_pages else {}
            return {"items": [{"metadata": {"namespace": "n", "name": f"c{page}", "uid": f"u{page}"}}],
                    "metadata": more}
        return {"items": []}


def test_unknown_node_is_a_clear_error_naming_the_nodes_that_have_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kube, "request", ScriptedApi(node_exists=False).request)
    with pytest.raises(StatusError) as err:
        asyncio.run(read_node(object(), "gpu-nod-1", DRIVER, lambda _: None))  # type: ignore[arg-type]
    assert "node 'gpu-nod-1' does not exist" in err.value.message
    assert "gpu-node-1, gpu-node-2" in err.value.message


def test_a_paged_read_shows_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube, "request", ScriptedApi(node_exists=True, claim_pages=3).request)
    lines: list[str] = []
    view = asyncio.run(read_node(object(), NODE, DRIVER, lines.append))  # type: ignore[arg-type]
    assert len(view.gpus) == 4
    assert lines == [f"reading ResourceClaims: {n} so far" for n in (1, 2, 3)]


def test_dynamic_mig_gpus_show_their_slices_held_placements_with_uuids_and_what_is_blocked() -> None:
    node = "mig-node"
    specs = desired_slices(discover("hgx-h200-mig"), node, DRIVER, SliceFeatures(dynamic_mig=True))
    mig_slices = [{"metadata": {"name": f"s{i}"},
                   "spec": {**s, "pool": {**s["pool"], "generation": 1, "resourceSliceCount": len(specs)}}}
                  for i, s in enumerate(specs)]

    def held(name: str, device: str, uuid: str | None) -> dict[str, Any]:
        c = claim(name, name, [{"device": device, "pool": node}], [(f"{name}-pod", f"p-{name}")])
        if uuid:
            c["status"]["devices"] = [
                {"driver": DRIVER, "pool": node, "device": device, "data": {"uuid": uuid}}]
        return c

    claims = [held("one", "gpu-0-mig-1g-18gb-19-0", "MIG-11111111-2222-3333-4444-555555555555"),
              held("three", "gpu-0-mig-3g-71gb-9-4", None)]
    view = node_view(node, DRIVER, mig_slices, claims, [pod("one-pod", "p-one", "Running")])
    gpus = {g.name: g for g in view.gpus}
    gpu0 = gpus["gpu-0"]
    assert gpu0.mig_mode and gpu0.memory == "MIG mode"  # published whole too, yet in MIG mode
    three = "gpu-0-mig-3g-71gb-9-4"
    assert gpu0.memory_slices == ("gpu-0-mig-1g-18gb-19-0", "free", "free", "free", *[three] * 4)
    assert "1g.18gb x3" in gpu0.can_carve and "7g.141gb x1" in gpu0.blocked
    devices = {d.name: d for d in gpu0.devices}
    assert devices["gpu-0-mig-1g-18gb-19-0"].uuid == "MIG-11111111-2222-3333-4444-555555555555"
    assert devices["gpu-0-mig-3g-71gb-9-4"].uuid == "(made at Prepare)"
    assert devices["gpu-0-mig-1g-18gb-19-4"].state == "blocked by gpu-0-mig-3g-71gb-9-4"
    assert devices["gpu-0"].state.startswith("blocked by gpu-0-mig-1g-18gb-19-0")
    assert gpus["gpu-1"].memory_slices[4:] == ("gpu-1-mig-3g71gb-4",) * 4  # the static instance
    # symmetric: GPU 1 publishes no whole device (its static instance), its peers still list it
    for g in view.gpus:
        for peer in g.nvlink_peers:
            assert g.index in gpus[f"gpu-{peer}"].nvlink_peers
    text = render(view)
    assert ("gpu-0 is in MIG mode; memory slices: 0: gpu-0-mig-1g-18gb-19-0; 1-3: free; "
            "4-7: gpu-0-mig-3g-71gb-9-4") in text
    assert not any(line.startswith("gpu-0-mig-1g-18gb-19-4 ") for line in text.splitlines())
    as_json = json.loads(json.dumps(asdict(view)))
    assert as_json["gpus"][0]["blocked"] == list(gpu0.blocked)


@pytest.mark.parametrize("profile", ["dgx1-v100", "bridged-triangles-v100", "ring8-v100", "hgx-h200"])
def test_the_nvlink_matrix_comes_from_the_clique_layers_without_nvlink_peers(profile: str) -> None:
    # nvlinkPeers is opt-in (--topology-detail-attributes): the default slices' layers give the same links
    inventory = discover(profile)
    truth: dict[int, tuple[int, ...]] | None = None
    for features in (SliceFeatures(), SliceFeatures(list_attributes=True),
                     SliceFeatures(topology_detail_attributes=True)):
        specs = desired_slices(inventory, NODE, DRIVER, features)
        objects = [{"metadata": {"name": f"s{i}"}, "spec": s} for i, s in enumerate(specs)]
        view = node_view(NODE, DRIVER, objects, [], [])
        got = {g.index: g.nvlink_peers for g in view.gpus}
        if truth is None:
            detailed = desired_slices(inventory, NODE, DRIVER, SliceFeatures(topology_detail_attributes=True))
            truth = {int(d["attributes"]["index"]["int"]): _published_peers(d)
                     for s in detailed for d in s.get("devices", []) if "index" in d.get("attributes", {})}
        assert got == truth, features


def _published_peers(device: dict[str, Any]) -> tuple[int, ...]:
    raw = device["attributes"].get("nvlinkPeers", {}).get("string", "")
    return tuple(int(p) for p in raw.split(",") if p)
