"""Where features meet (issue 38): each test is a defect found at an edge between two
features, checked here so that it cannot come back.

- NVIDIA's MigDeviceConfig on a dynamic MIG slice is honoured as on static MIG (TimeSlicing
  as it is, MPS with the made instance's MIG UUID); GpuConfig on a slice is refused with
  what to change.
- A pinned-memory limit above the device's own memory is refused on the node with the numbers.
- A fatal XID among a storm of harmless ones names the taint and the health record.
- A plugin never takes over an MPS root of another driver (it would stop that driver's
  daemons and delete their pipe directories).
- The whole-GPU class never selects a GPU in MIG mode: such a GPU carries `migEnabled`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.attributes import device_attributes
from controller.slices import SliceFeatures, desired_slices
from dra_driver.devices import node_devices
from dra_driver.gpu import choose_backend, discover
from dra_driver.gpu.sim.fake_nvml import FakeNvml
from dra_driver.health.classify import HealthPolicy
from dra_driver.health.node import start_node_health
from dra_driver.plugin.claims import ClaimRef
from dra_driver.sharing.mps import errors as mps_errors
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.mps.settings import MpsSettings
from dra_driver.sharing.policy import Sharing
from tests.harness.claims_in_memory import with_spec
from tests.harness.objects import wait_for_async
from tests.unit.test_dynamic_mig_state import DRIVER, NODE, SLICE_3G, STATIC_3G, MigNode

NV = "resource.nvidia.com/v1beta1"
MIG_ENABLED = "migEnabled"  # NVIDIA's name (controller.attributes.MIG_ENABLED)
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


class RecordingMps(MpsControl):
    """MPS without daemons: what the plugin would start, recorded."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, "/nonexistent-driver-root", private_shm=False)
        self.started: list[MpsSettings] = []

    def start(self, settings: MpsSettings) -> None:
        self.dirs(settings.claim_uid).base.mkdir(parents=True, exist_ok=True)
        self.started.append(settings)

    def is_running(self, claim_uid: str) -> bool:
        return False

    def stop(self, claim_uid: str) -> bool:
        self._remove(claim_uid)
        return True


def configured(node: MigNode, ref: ClaimRef, parameters: dict[str, Any]) -> None:
    """The claim with a config of its own, as the scheduler copies it into the allocation."""
    claim = {k: v for k, v in node.claims[ref.uid].items() if k != "spec"}
    claim["status"]["allocation"]["devices"]["config"] = [
        {"source": "FromClaim", "requests": ["mig"], "opaque": {"driver": DRIVER, "parameters": parameters}}
    ]
    node.claims[ref.uid] = with_spec(claim)


def prepare_with(
    tmp_path: Path, device: str, parameters: dict[str, Any]
) -> tuple[Any, MigNode, RecordingMps]:
    async def run() -> tuple[Any, MigNode, RecordingMps]:
        node = MigNode(tmp_path)
        p = await node.restart()
        mps = RecordingMps(tmp_path / "mps")
        p.steps = dataclasses.replace(p.steps, sharing=Sharing(DRIVER, NODE, mps))
        ref = node.add("a", device)
        configured(node, ref, parameters)
        return (await p.prepare([ref]))[ref.uid], node, mps

    return asyncio.run(run())


# --------------------------------------------------------------------------- MIG configs


@pytest.mark.parametrize("device", [SLICE_3G, STATIC_3G], ids=["dynamic", "static"])
def test_nvidias_mig_device_config_with_time_slicing_runs_on_a_mig_slice(tmp_path: Path, device: str) -> None:
    """NVIDIA's gpu-simple-mig-ts: refused on a dynamic slice as "a whole GPU" on d20fbb0."""
    parameters = {"apiVersion": NV, "kind": "MigDeviceConfig", "sharing": {"strategy": "TimeSlicing"}}
    result, _, mps = prepare_with(tmp_path, device, parameters)
    assert result.error is None, result.error
    assert mps.started == []  # time-slicing is the GPU's own default: nothing to start


def test_nvidias_mig_device_config_with_mps_serves_the_made_instance(tmp_path: Path) -> None:
    parameters = {
        "apiVersion": NV,
        "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 30}},
    }
    result, node, mps = prepare_with(tmp_path, SLICE_3G, parameters)
    assert result.error is None, result.error
    (made,) = [x for x in node.live() if x.gpu == 0]
    (settings,) = mps.started
    assert [d.uuid for d in settings.devices] == [made.uuid]  # the MIG UUID, not the parent GPU's
    assert settings.active_thread_percentage == 30
    assert settings.exclusive_gpus == ()  # a MIG device's compute mode is its GPU's: never changed


@pytest.mark.parametrize("device", [SLICE_3G, STATIC_3G], ids=["dynamic", "static"])
def test_gpu_config_on_a_mig_slice_is_refused_with_what_to_change(tmp_path: Path, device: str) -> None:
    """d20fbb0 accepted a GpuConfig on a dynamic slice, the inverse of docs/migrating.md."""
    parameters = {"apiVersion": NV, "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}}
    result, node, _ = prepare_with(tmp_path, device, parameters)
    assert result.error is not None
    assert (
        f"cannot apply GpuConfig to device {device}, a MIG device: use kind MigDeviceConfig" in result.error
    )
    assert [x for x in node.live() if x.gpu == 0] == [], "nothing made for a refused claim"


# --------------------------------------------------------------------------- limits against memory


def test_a_pinned_limit_above_the_gpus_memory_holds_it_to_all_of_its_memory() -> None:
    devices = node_devices(discover("hgx-h200"))
    gpu = devices["gpu-0"]
    claim = {
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}],
                    "config": [
                        {
                            "source": "FromClaim",
                            "opaque": {
                                "driver": DRIVER,
                                "parameters": {
                                    "apiVersion": NV,
                                    "kind": "GpuConfig",
                                    "sharing": {
                                        "strategy": "MPS",
                                        "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "200Gi"},
                                    },
                                },
                            },
                        }
                    ],
                }
            }
        }
    }
    sharing = Sharing(DRIVER, NODE, MpsControl("/nonexistent", "/nonexistent"))
    # Above the GPU's memory: held to all of it, which is what the limit means (it was refused
    # here, and the claim held the GPU without running: issue 49).
    plan = sharing.plan("u1", claim, [gpu])
    assert plan is not None and plan.devices[0].pinned_memory_limit == gpu.gpu.memory_bytes // 2**20 * 2**20
    fits = json.loads(json.dumps(claim).replace("200Gi", "100Gi"))
    plan = sharing.plan("u1", fits, [gpu])
    assert plan is not None and plan.devices[0].pinned_memory_limit == 100 * 2**30


# --------------------------------------------------------------------------- health attribution


def test_a_fatal_xid_in_a_storm_of_harmless_ones_names_the_taint_and_the_record() -> None:
    """d20fbb0: the first XID 13 read after the fatal 79 took the GPU's recovery action, so
    the taint and the record named XID 13."""
    inventory = discover("hgx-h200")

    async def scenario() -> tuple[list[str], str]:
        nvml = choose_backend("hgx-h200").nvml
        assert isinstance(nvml, FakeNvml) and nvml.events is not None
        health = await start_node_health(inventory, node_devices(inventory), DRIVER, HealthPolicy(), nvml)
        try:
            nvml.events.inject({"gpu": 2, "xid": 13, "repeat": 300})
            nvml.events.inject({"gpu": 2, "xid": 79, "recovery_action": 1})
            nvml.events.inject({"gpu": 2, "xid": 13, "repeat": 300})

            def xid_taint() -> bool:
                return any(t.key.endswith("/xid") for t in health.keeper.views["gpu-2"].taints)

            await wait_for_async("gpu-2 tainted by an XID", xid_taint, timeout=60)
            view = health.keeper.views["gpu-2"]
            return [f"{t.key}={t.value}" for t in view.taints if t.key.endswith("/xid")], view.message
        finally:
            await health.stop()

    taints, message = asyncio.run(scenario())
    assert taints == [f"{DRIVER}/xid=79"]
    assert "XID 79" in message and "XID 13" not in message


# --------------------------------------------------------------------------- MPS root


def test_an_mps_root_of_another_driver_is_refused_and_left_untouched(tmp_path: Path) -> None:
    root = tmp_path / "mps"
    a = MpsControl(root, "/nonexistent")
    assert hasattr(a, "claim_root"), "no check of who owns the MPS root"
    a.claim_root("gpu.dra-driver.dev")
    (root / "uid-of-a" / "pipe").mkdir(parents=True)  # a claim of A's, with its daemon's pipes
    before = sorted(str(p) for p in root.rglob("*"))
    b = MpsControl(root, "/nonexistent")
    with pytest.raises(
        mps_errors.MpsRootOfAnotherDriver,
        match=r"belongs to driver gpu.dra-driver.dev, and this plugin is "
        r"driver other.example.com: two drivers must not share an MPS root",
    ):
        b.claim_root("other.example.com")
    assert sorted(str(p) for p in root.rglob("*")) == before
    a.claim_root("gpu.dra-driver.dev")  # a restart (or the next instance of a rolling update) of A


# --------------------------------------------------------------------------- the whole-GPU class


def test_a_gpu_in_mig_mode_says_so_and_the_whole_gpu_class_selects_on_it() -> None:
    inventory = discover("hgx-h200-mig")
    specs = desired_slices(inventory, NODE, DRIVER, SliceFeatures(dynamic_mig=True))
    whole = {
        d["name"]: d["attributes"].get(MIG_ENABLED)
        for s in specs
        for d in s.get("devices", [])
        if d["attributes"]["type"]["string"] == "gpu"
    }
    in_mig_mode = {f"gpu-{g.index}" for g in inventory.gpus if g.mig_enabled}
    assert in_mig_mode and {n for n, v in whole.items() if v == {"bool": True}} == in_mig_mode & set(whole)
    assert all(v is None for n, v in whole.items() if n not in in_mig_mode)
    plain = node_devices(discover("hgx-h200"))["gpu-0"]
    assert (
        MIG_ENABLED
        not in device_attributes(plain, discover("hgx-h200"), None, list_attributes=False).attributes
    )
    for path in ("gpu.yaml", "gpu-extended-resource.yaml"):
        (cls,) = yaml.safe_load_all((DEPLOY / "deviceclasses" / path).read_text())
        expression = " ".join(cls["spec"]["selectors"][0]["cel"]["expression"].split())
        assert (
            f'!("migEnabled" in device.attributes["{DRIVER}"] && device.attributes["{DRIVER}"].migEnabled)'
            in (expression)
        ), path
