"""The deploy/ examples and DeviceClasses, the simulated boxes they run on, and their ResourceSlices.

`DEMO_NODES` are the three boxes of `make demo` (tests.harness.node runs each as a real
node with a simulated driver); the integration and node tiers run the same examples on
them. Test plumbing only: it must NOT print reports (that is `demo/`) nor call the plugin.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client

from dra_driver.jsontypes import JSON
from tests.harness.bodies import claim_pod, claim_template
from tests.harness.cluster import REPO_ROOT
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.node import NodeSpec
from tests.harness.objects import RESOURCE_API, sync_request

DeviceMap = dict[tuple[str, str], JSON]  # (pool, device name) -> the device in its ResourceSlice
TOO_BIG_SELECTOR = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("200Gi")) >= 0'


@dataclass(frozen=True)
class SimulatedNode:
    name: str
    profile: str  # `dra-driver inventory --list-profiles`
    description: str


DEMO_NODES: tuple[SimulatedNode, ...] = (
    SimulatedNode("dgx1-v100", "dgx1-v100", "hybrid cube-mesh: each GPU has NVLink to 4 of the 7 others"),
    SimulatedNode("a100-pcie", "a100-pcie-bridged", "PCIe cards, NVLink bridges join only 0-1 and 2-3"),
    SimulatedNode("hgx-h200", "hgx-h200", "NVSwitch: every GPU linked to every other"),
)
# Dynamic MIG (docs/mig.md) on a box of its own, started by the demo only: the test tiers
# keep their three boxes, and tests/node/test_dynamic_mig.py starts its own MIG node.
MIG_NODE = SimulatedNode(
    "h200-mig",
    "hgx-h200-mig",
    "H200s in MIG mode, carved on demand (--dynamic-mig); GPU 1 holds a static 3g.71gb",
)
# The examples keep to the three boxes they were written for; only the MIG pod tolerates this.
MIG_TAINT: JSON = {"key": "gpu-demo/dynamic-mig", "value": "only", "effect": "NoSchedule"}


def node_specs(nodes: Sequence[SimulatedNode] = DEMO_NODES) -> tuple[NodeSpec, ...]:
    """The demo's boxes as real nodes (tests.harness.node), one simulated driver each."""
    return tuple(NodeSpec(n.name, n.profile) for n in nodes)


def deploy_dir() -> Path:
    return REPO_ROOT / "deploy"


def example_files() -> list[Path]:
    return sorted((deploy_dir() / "examples").glob("*.yaml"))


# The scheduler places the unconstrained examples wherever it likes; applied before
# them, the examples that need a particular box (or a particular set of GPUs on it)
# always find it free, so every run of the demo ends the same way.
MOST_CONSTRAINED_FIRST = ("06-", "04-", "10-", "07-", "05-")


def apply_order(files: Sequence[Path]) -> list[Path]:
    def rank(path: Path) -> tuple[int, str]:
        prefix = next((i for i, p in enumerate(MOST_CONSTRAINED_FIRST) if path.name.startswith(p)), None)
        return (prefix if prefix is not None else len(MOST_CONSTRAINED_FIRST), path.name)

    return sorted(files, key=rank)


def device_class_files() -> list[Path]:
    return sorted((deploy_dir() / "deviceclasses").glob("*.yaml"))


def too_big_pod() -> list[JSON]:
    """A claim no node can satisfy (200Gi on one GPU): shows the scheduler's reason, harms nothing."""
    request = {"name": "gpu", "exactly": {"deviceClassName": DRIVER,
                                          "selectors": [{"cel": {"expression": TOO_BIG_SELECTOR}}]}}
    template = claim_template("gpu-200gi", {"requests": [request]})
    pod = claim_pod("too-big-200gi", {"resourceClaimTemplateName": "gpu-200gi"})
    return [template, pod]


# -- ResourceSlices ------------------------------------------------------------------------


def published_devices(api: client.ApiClient) -> DeviceMap:
    """Every device of our driver's slices, by (pool, device name)."""
    slices = sync_request(
        api, "GET", f"{RESOURCE_API}/resourceslices", query={"fieldSelector": f"spec.driver={DRIVER}"}
    )["items"]
    return {(s["spec"]["pool"]["name"], d["name"]): d for s in slices for d in s["spec"].get("devices", [])}


def wait_for_slices(
    api: client.ApiClient, drivers: Sequence[DriverProcess], timeout: float = 60.0
) -> DeviceMap:
    """Wait until every node's pool is complete (all `resourceSliceCount` slices of its newest generation)."""
    deadline = time.monotonic() + timeout
    while True:
        for driver in drivers:
            driver.check_alive()
        slices = sync_request(
            api, "GET", f"{RESOURCE_API}/resourceslices", query={"fieldSelector": f"spec.driver={DRIVER}"}
        )["items"]
        if all(_pool_complete(slices, d.node) for d in drivers):
            return published_devices(api)
        if time.monotonic() > deadline:
            missing = [d.node for d in drivers if not _pool_complete(slices, d.node)]
            raise TimeoutError(f"no complete ResourceSlice pool after {timeout}s for: {', '.join(missing)}")
        time.sleep(0.2)  # the poll interval


def _pool_complete(slices: Sequence[JSON], node: str) -> bool:
    mine = [s["spec"] for s in slices if s["spec"].get("nodeName") == node]
    if not mine:
        return False
    newest = max(s["pool"]["generation"] for s in mine)
    current = [s for s in mine if s["pool"]["generation"] == newest]
    return len(current) == current[0]["pool"]["resourceSliceCount"] and any(s.get("devices") for s in current)
