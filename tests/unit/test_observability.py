"""docs/observability.md's PromQL join, evaluated on a Prometheus text payload that holds the
driver's own series (as the plugin exposes them after a Prepare) and DCGM-shaped per-GPU
series; and the Grafana dashboard: it loads, each panel queries series that exist, and each
panel is described in the docs.

The evaluator covers exactly the query's shape (label_replace, then `* on (L) group_left (..)`),
with PromQL's rules for it: matching on L only, the right side one series per match (else a
many-to-many error), the left side's labels plus the group_left labels, metric name dropped."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dra_driver import kube, metrics
from dra_driver.devices import node_devices
from dra_driver.gpu import discover
from dra_driver.plugin.claim_status import ClaimStatus, nvlink_peers
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.prepared import PreparedDevice
from dra_driver.sharing.shares import share_views

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "observability.md"
DASHBOARD = REPO / "deploy" / "grafana" / "gpu-dra-driver.json"
NODE = "node-a"
SHARE = "0a4f6a36-8a5e-4d2c-9a4b-3c1b2b3f7e11"
JOIN = re.compile(
    r'label_replace\((\w+), "(\w+)", "\$1", "(\w+)", "\(\.\+\)"\)'
    r"\s*\*\s*on \((\w+)\) group_left \(([\w, ]*)\)\s*(\w+)"
)
Sample = tuple[dict[str, str], float]


def doc_query() -> str:
    [query] = re.findall(r"```promql\n(.*?)```", DOC.read_text(), re.S)
    return str(query)


def evaluate(query: str, samples: dict[str, list[Sample]]) -> list[Sample]:
    match = JOIN.fullmatch(query.strip())
    assert match, f"the docs' query is not of the shape this test evaluates: {query}"
    left_name, dst, src, on, group_left, right_name = match.groups()
    copied = [g.strip() for g in group_left.split(",") if g.strip()]
    right: dict[str, Sample] = {}
    for labels, value in samples.get(right_name, []):
        key = labels.get(on, "")
        assert key not in right, f"many-to-many: two {right_name} series with {on}={key}"
        right[key] = (labels, value)
    out = []
    for labels, value in samples.get(left_name, []):
        relabelled = {**labels, dst: labels[src]}
        found = right.get(relabelled.get(on, ""))
        if found is None:
            continue
        extra = {k: found[0][k] for k in copied if k in found[0]}
        out.append(({**relabelled, **extra}, value * found[1]))
    return out


def dcgm_payload(gpus: list[Any], util: dict[int, float]) -> str:
    lines = ["# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).", "# TYPE DCGM_FI_DEV_GPU_UTIL gauge"]
    for g in gpus:
        lines.append(
            f'DCGM_FI_DEV_GPU_UTIL{{gpu="{g.index}",UUID="{g.uuid}",pci_bus_id="0000{g.pci_bus_id}",'
            f'device="nvidia{g.minor}",modelName="{g.product_name}",Hostname="{NODE}",'
            f'DCGM_FI_DRIVER_VERSION="570.195.03"}} {util[g.index]}'
        )
    return "\n".join(lines) + "\n"


def test_the_documented_join_gives_each_pod_its_gpu_utilisation(monkeypatch: pytest.MonkeyPatch) -> None:
    inventory = discover("hgx-h200")
    devices = node_devices(inventory)
    devices.update(share_views(devices))
    claims = {
        "c-train": ({"metadata": {"namespace": "ml", "name": "train", "uid": "c-train"},
                     "status": {"reservedFor": [{"resource": "pods", "name": "trainer", "uid": "p1"}]}},
                    [PreparedDevice(("gpu",), NODE, "gpu-3", ())]),
        "c-share": ({"metadata": {"namespace": "web", "name": "small", "uid": "c-share"},
                     "status": {"reservedFor": [{"resource": "pods", "name": "a", "uid": "p2"},
                                                {"resource": "pods", "name": "b", "uid": "p3"}]}},
                    [PreparedDevice(("gpu",), NODE, "gpu-5-share", (), share_id=SHARE)]),
    }

    async def request(api: object, method: str, path: str, **_: Any) -> dict[str, Any]:
        if method == "GET":
            return next(c for c, _ in claims.values() if path.endswith("/" + c["metadata"]["name"]))
        return {}

    monkeypatch.setattr(kube, "request", request)
    status = ClaimStatus(object(), "gpu.dra-driver.dev", NODE, devices, nvlink_peers(inventory, devices))  # type: ignore[arg-type]

    async def prepare(unprepare: bool = False) -> None:
        for uid, (claim, prepared) in claims.items():
            ref = ClaimRef(claim["metadata"]["namespace"], claim["metadata"]["name"], uid)
            if unprepare:
                status.unprepared(ref)
            else:
                status.prepared(ref, prepared)
        await status.settled()

    util = {g.index: 10.0 * g.index for g in inventory.gpus}

    def joined() -> list[tuple[str, str, str, float]]:
        payload = generate_latest(metrics.REGISTRY).decode() + dcgm_payload(list(inventory.gpus), util)
        samples: dict[str, list[Sample]] = {}
        for family in text_string_to_metric_families(payload):
            for s in family.samples:
                samples.setdefault(s.name, []).append((s.labels, s.value))
        return sorted((r["pod_namespace"], r["pod_name"], r["modelName"], v)
                      for r, v in evaluate(doc_query(), samples))

    asyncio.run(prepare())
    assert joined() == [("ml", "trainer", "NVIDIA H200", 30.0), ("web", "a", "NVIDIA H200", 50.0),
                        ("web", "b", "NVIDIA H200", 50.0)]
    asyncio.run(prepare(unprepare=True))
    assert joined() == []


def test_the_dashboard_loads_queries_existing_series_and_each_panel_is_described() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    doc = DOC.read_text()
    exposed = {s.name for m in metrics.REGISTRY.collect() for s in m.samples} | {
        m.name for m in metrics.REGISTRY.collect()}
    exposed |= {f"{m.name}_bucket" for m in metrics.REGISTRY.collect() if m.type == "histogram"}
    exposed |= {f"{m.name}_total" for m in metrics.REGISTRY.collect() if m.type == "counter"}
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        assert f"**{panel['title']}**" in doc, f"panel {panel['title']!r} is not described in {DOC.name}"
        for target in panel["targets"]:
            names = set(re.findall(r"\b(gpu_dra_\w+|DCGM_\w+)", target["expr"]))
            assert names, target["expr"]
            ours = {n for n in names if n.startswith("gpu_dra_")}
            assert ours <= exposed, (panel["title"], ours - exposed)
