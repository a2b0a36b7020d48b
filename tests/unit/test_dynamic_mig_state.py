"""Dynamic MIG through the prepare transaction, on FakeNvml whose MIG instances are kept in a
file (so they outlive a "killed" plugin, as on a GPU): Prepare records the intent, creates the
instance and writes its CDI spec; Unprepare destroys it; a taken placement fails the claim and
changes nothing; a crash at each point followed by a restart leaves no orphan instance and no
lost claim. The crash is a BaseException raised at the plugin's own fault points (the unit
tier starts no processes; the node tier kills the real plugin with -9 at the same point)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog.testing

from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.cdi.files import claim_spec_path
from dra_driver.devices import node_devices
from dra_driver.driver_root import simulated_driver_files
from dra_driver.gpu import discover, load_profile
from dra_driver.gpu.mig import Created, MigError, MigInstances
from dra_driver.gpu.mig_profiles import GiProfile, table_for
from dra_driver.gpu.sim.fake_nvml import FakeNvml
from dra_driver.gpu.sim.mig import FakeMig, LiveInstance
from dra_driver.health.classify import HealthPolicy
from dra_driver.health.events import EventKind, HealthEvent
from dra_driver.health.keeper import HealthKeeper
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin import transaction
from dra_driver.plugin.claims import ClaimRef, ClaimRejected
from dra_driver.plugin.mig_steps import CreatedDevices, dynamic_devices, without_own
from dra_driver.plugin.recovery import StartPaths, asked_once, instances_at_start
from dra_driver.plugin.state import ClaimResult, NodePreparer
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.policy import Sharing
from tests.harness.claims_in_memory import with_spec

NODE = "node-a"
BOOT = "boot-1"
PROFILE = "hgx-h200-mig"  # GPU 0: MIG mode, empty; GPU 1: MIG mode, static 3g.71gb at 4-7; GPU 2: whole
SLICE_3G = "gpu-0-mig-3g-71gb-9-4"
STATIC_3G = "gpu-1-mig-3g71gb-4"


class Crash(BaseException):
    """The plugin dying at a fault point (nothing after it runs, no except clause catches it)."""


class MigNode:
    """A simulated node with dynamic MIG; `restart()` is a new plugin over the same state dir,
    CDI dir and MIG instances, wired as `dra-driver kubelet-plugin --dynamic-mig` wires it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mig_state = root / "simulated-mig.json"
        self.claims: dict[str, dict[str, Any]] = {}
        (root / "state").mkdir(parents=True)

    async def read(self, refs: Sequence[ClaimRef]) -> dict[str, dict[str, Any] | ClaimRejected]:
        return {r.uid: self.claims.get(r.uid) or ClaimRejected(f"no claim {r}") for r in refs}

    async def allocated_here(self, driver: str, pool: str) -> list[dict[str, Any]] | None:
        return list(self.claims.values())

    def nvml(self) -> FakeNvml:
        return FakeNvml(load_profile(PROFILE), mig_state_file=self.mig_state)

    def live(self) -> list[LiveInstance]:
        return FakeMig(load_profile(PROFILE).gpus, self.mig_state).live()

    def checkpoint(self) -> ckpt.Checkpoint:
        return ckpt.load(ckpt.checkpoint_path(self.root / "state"), BOOT, DRIVER).checkpoint

    async def restart(self) -> NodePreparer:
        inventory = discover(PROFILE, self.mig_state)
        paths = StartPaths(ckpt.checkpoint_path(self.root / "state"), BOOT, DRIVER, NODE, self.root / "cdi")
        self.listings = 0
        listed = asked_once(self.listed)
        own = await instances_at_start(inventory, paths, listed)
        inventory = without_own(inventory, own)
        placements, carved = dynamic_devices(inventory)
        self.devices = {**node_devices(inventory), **carved}
        p = NodePreparer(
            driver=DRIVER,
            pool=NODE,
            devices=self.devices,
            claims=self,
            driver_files=simulated_driver_files([g.minor for g in inventory.gpus]),
            cdi_dir=self.root / "cdi",
            state_dir=self.root / "state",
            sharing=Sharing(DRIVER, NODE, MpsControl(self.root / "mps", "/nonexistent-driver-root")),
            boot_id=BOOT,
            mig=MigInstances(self.nvml()),
            placements=placements,
        )
        await p.recover(listed)
        return p

    async def listed(self) -> list[dict[str, Any]] | None:
        self.listings += 1
        return await self.allocated_here(DRIVER, NODE)

    def add(self, name: str, *devices: str) -> ClaimRef:
        ref = ClaimRef("ns", name, f"uid-{name}")
        results = [{"request": "mig", "driver": DRIVER, "pool": NODE, "device": d} for d in devices]
        self.claims[ref.uid] = with_spec({
            "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
            "status": {"allocation": {"devices": {"results": results}}},
        })
        return ref

    def spec(self, ref: ClaimRef) -> dict[str, Any] | None:
        path = claim_spec_path(self.root / "cdi", DRIVER, ref.uid)
        return json.loads(path.read_text()) if path.exists() else None


def dynamic(node: MigNode) -> list[tuple[int, int, int]]:
    """(gpu, profile id, start) of every instance that is not the profile's static one."""
    return sorted((x.gpu, x.profile_id, x.placement) for x in node.live() if (x.gpu, x.placement) != (1, 4))


def die_at(point: str) -> Callable[[str], None]:
    def fault(where: str) -> None:
        if where == point:
            raise Crash(point)

    return fault


def profile_id(name: str) -> int:
    return next(p.id for p in table_for("NVIDIA H200") if p.name == name)


def test_prepare_creates_the_instance_and_unprepare_destroys_it(tmp_path: Path) -> None:
    async def run() -> None:
        node = MigNode(tmp_path)
        p = await node.restart()
        ref = node.add("a", SLICE_3G)
        result = (await p.prepare([ref]))[ref.uid]
        assert result.error is None, result.error
        assert [d.device for d in result.devices] == [SLICE_3G]
        assert dynamic(node) == [(0, profile_id("3g.71gb"), 4)]
        (made,) = [x for x in node.live() if x.gpu == 0]
        (record,) = node.checkpoint().claims[ref.uid].mig  # read back from the file
        assert (record.device, record.gpu_instance_id) == (SLICE_3G, made.gpu_instance_id)
        assert record.uuid == made.uuid
        assert record.compute_instance_id == made.compute_instance_id and record.start == 4
        spec = node.spec(ref)
        assert spec is not None and made.uuid is not None and made.uuid in json.dumps(spec)
        caps = [n["path"] for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", [])]
        assert any(c.startswith("/dev/nvidia-caps/nvidia-cap") for c in caps), caps
        records = node.checkpoint().claims[ref.uid].mig
        described = CreatedDevices(node.devices, p.steps.placements, lambda: records)
        assert described[SLICE_3G].uuid == made.uuid, "the claim's status names the instance, not the parent"
        assert described["gpu-2"] == node.devices["gpu-2"] and len(described) == len(node.devices)
        assert await p.prepare([ref]) == {ref.uid: result}, "a retry neither creates nor changes anything"
        assert dynamic(node) == [(0, profile_id("3g.71gb"), 4)]
        assert await p.unprepare([ref]) == {ref.uid: ClaimResult()}
        assert dynamic(node) == [] and node.spec(ref) is None and node.checkpoint().claims == {}
        assert [(x.gpu, x.placement) for x in node.live()] == [(1, 4)], "the static instance is untouched"

    asyncio.run(run())


def test_a_taken_placement_fails_the_claim_and_changes_nothing(tmp_path: Path) -> None:
    async def run() -> None:
        node = MigNode(tmp_path)
        p = await node.restart()
        gpu0 = discover(PROFILE).gpus[0]
        one_g = next(x for x in gpu0.mig_profiles if x.name == "1g.18gb")
        MigInstances(node.nvml()).create(gpu0.uuid, one_g, 5)  # by hand, after the slices were published
        before = node.live()
        ref = node.add("a", SLICE_3G)
        error = (await p.prepare([ref]))[ref.uid].error
        assert error is not None and "taken" in error and "slices 5-5" in error
        assert "nothing was changed" in error
        assert node.live() == before and node.checkpoint().claims == {} and node.spec(ref) is None
        other = node.add("b", "gpu-0-mig-3g-71gb-9-0")  # the other half is free: it works
        assert (await p.prepare([other]))[other.uid].error is None

    asyncio.run(run())


def test_static_mig_and_whole_gpus_prepare_as_before(tmp_path: Path) -> None:
    async def run() -> None:
        node = MigNode(tmp_path)
        p = await node.restart()
        ref = node.add("a", STATIC_3G, "gpu-2")
        result = (await p.prepare([ref]))[ref.uid]
        assert result.error is None, result.error
        assert dynamic(node) == [] and node.checkpoint().claims[ref.uid].mig == ()
        static_uuid = next(x.uuid for x in node.live() if x.gpu == 1)
        assert static_uuid is not None and static_uuid in json.dumps(node.spec(ref))
        assert await p.unprepare([ref]) == {ref.uid: ClaimResult()}
        assert [(x.gpu, x.placement) for x in node.live()] == [(1, 4)], "a static instance is never destroyed"

    asyncio.run(run())


def test_two_slices_of_one_claim_and_a_failure_undoes_what_was_made(tmp_path: Path) -> None:
    async def run() -> None:
        node = MigNode(tmp_path)
        p = await node.restart()
        ref = node.add("two", "gpu-0-mig-1g-18gb-19-0", "gpu-0-mig-1g-18gb-19-1")
        assert (await p.prepare([ref]))[ref.uid].error is None
        assert dynamic(node) == [(0, 19, 0), (0, 19, 1)]
        mig = p.steps.mig
        assert mig is not None
        create = mig.create
        calls: list[int] = []

        def second_fails(parent: str, profile: GiProfile, start: int) -> Created:
            calls.append(start)
            if len(calls) == 2:  # an NVML failure the free-placement check cannot foresee
                raise MigError(f"GPU {parent}: creating the GPU instance failed: Unknown Error")
            return create(parent, profile, start)

        mig.create = second_fails  # type: ignore[method-assign]
        bad = node.add("bad", "gpu-0-mig-1g-18gb-19-2", "gpu-0-mig-1g-18gb-19-3")
        error = (await p.prepare([bad]))[bad.uid].error
        assert error is not None and "creating the GPU instance failed" in error and calls == [2, 3]
        assert dynamic(node) == [(0, 19, 0), (0, 19, 1)], "the slice made at 2 is destroyed again"
        assert bad.uid not in node.checkpoint().claims and node.spec(bad) is None
        assert await p.unprepare([ref]) == {ref.uid: ClaimResult()} and dynamic(node) == []

    asyncio.run(run())


@pytest.mark.parametrize("point", ["prepare-after-started", "prepare-after-mig-create", "prepare-after-cdi"])
def test_a_crash_before_the_claim_is_recorded_leaves_no_orphan_and_no_lost_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    async def run() -> None:
        node = MigNode(tmp_path)
        p = await node.restart()
        ref = node.add("a", SLICE_3G)
        with monkeypatch.context() as m:
            m.setattr(transaction, "fault", die_at(point))
            with pytest.raises(Crash):
                await p.prepare([ref])
        entry = node.checkpoint().claims[ref.uid]
        assert entry.phase == ckpt.ClaimPhase.STARTED
        assert entry.mig[0].gpu_instance_id is None, "only the intent is recorded"
        if point != "prepare-after-started":
            assert dynamic(node) == [(0, profile_id("3g.71gb"), 4)], "the instance outlives the plugin"
        p = await node.restart()
        assert dynamic(node) == [], "the instance of an interrupted prepare is destroyed: no orphan"
        assert node.checkpoint().claims == {} and node.spec(ref) is None
        assert SLICE_3G in node.devices, "after the restart the placement is published and preparable again"
        result = (await p.prepare([ref]))[ref.uid]  # the kubelet's retry: the claim is not lost
        assert result.error is None, result.error
        assert dynamic(node) == [(0, profile_id("3g.71gb"), 4)]
        assert await p.unprepare([ref]) == {ref.uid: ClaimResult()} and dynamic(node) == []

    asyncio.run(run())


def test_a_restart_after_prepare_adopts_the_instance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> None:
        node = MigNode(tmp_path)
        p = await node.restart()
        ref = node.add("a", SLICE_3G)
        with monkeypatch.context() as m:
            m.setattr(transaction, "fault", die_at("prepare-after-completed"))
            with pytest.raises(Crash):
                await p.prepare([ref])
        made = node.live()
        spec = node.spec(ref)
        p = await node.restart()
        assert node.live() == made, "adopted: nothing destroyed, nothing created"
        assert SLICE_3G in node.devices and STATIC_3G in node.devices
        assert not any(d.startswith("gpu-0-mig-3g71gb") for d in node.devices), "not taken for a static one"
        entry = node.checkpoint().claims[ref.uid]
        assert entry.phase == ckpt.ClaimPhase.COMPLETED and entry.mig[0].created
        claim_spec_path(tmp_path / "cdi", DRIVER, ref.uid).unlink()  # someone cleans the CDI dir
        p = await node.restart()
        assert node.spec(ref) == spec, "the spec is rebuilt from the recorded ids and MIG UUID"
        result = (await p.prepare([ref]))[ref.uid]
        assert result.error is None and node.live() == made
        assert await p.unprepare([ref]) == {ref.uid: ClaimResult()} and dynamic(node) == []

    asyncio.run(run())


def test_a_placement_without_dynamic_mig_is_refused_with_what_to_do(tmp_path: Path) -> None:
    async def run() -> None:
        node = MigNode(tmp_path)
        p = await node.restart()
        p.steps = dataclasses.replace(p.steps, mig=None)
        ref = node.add("a", SLICE_3G)
        error = (await p.prepare([ref]))[ref.uid].error
        assert error is not None and "--dynamic-mig" in error and dynamic(node) == []

    asyncio.run(run())


def test_an_xid_on_a_made_instance_taints_its_placement_only(tmp_path: Path) -> None:
    async def run() -> None:
        node = MigNode(tmp_path)
        p = await node.restart()
        records: list[Any] = []
        keeper = HealthKeeper(DRIVER, CreatedDevices(node.devices, p.steps.placements, lambda: records),
                              HealthPolicy())
        ref = node.add("a", SLICE_3G)
        assert (await p.prepare([ref]))[ref.uid].error is None
        records.extend(node.checkpoint().claims[ref.uid].mig)  # what the plugin's reader sees now
        (r,) = records
        xid = HealthEvent(gpu=0, kind=EventKind.XID, data=79, gpu_instance=r.gpu_instance_id,
                          compute_instance=r.compute_instance_id)
        assert keeper.apply([xid])
        tainted = {name for name, ts in keeper.snapshot().taints().items() if ts}
        assert tainted == {SLICE_3G}, "the instance's own XID: its placement, not the rest of GPU 0"
        assert keeper.apply([HealthEvent(gpu=0, kind=EventKind.XID, data=79)])
        tainted = {name for name, ts in keeper.snapshot().taints().items() if ts}
        assert "gpu-0" in tainted and "gpu-0-mig-1g-18gb-19-0" in tainted, "a whole-GPU XID: all of GPU 0"
        assert not any(name.startswith("gpu-1") for name in tainted)

    asyncio.run(run())


def lose_checkpoint(node: MigNode, how: str) -> None:
    path = ckpt.checkpoint_path(node.root / "state")
    if how == "corrupt":
        path.write_text('{"version": 1, "claims": {')  # torn: recovery moves it aside
    else:
        path.unlink()  # the state dir wiped while the pod runs


@pytest.mark.parametrize("how", ["corrupt", "missing"])
def test_a_lost_checkpoint_adopts_a_live_claim_with_its_instance(tmp_path: Path, how: str) -> None:
    async def run() -> None:
        node = MigNode(tmp_path)
        p = await node.restart()
        ref = node.add("a", SLICE_3G)
        assert (await p.prepare([ref]))[ref.uid].error is None
        made = node.live()
        (instance,) = [x for x in made if x.gpu == 0]
        spec = node.spec(ref)
        lose_checkpoint(node, how)
        p = await node.restart()
        assert node.listings == 1, "discovery and recovery share one answer of the API server"
        assert node.live() == made, "adopted: nothing destroyed, nothing created"
        assert not any(d.startswith("gpu-0-mig-3g71gb") for d in node.devices), "not taken for a static one"
        assert SLICE_3G in node.devices and STATIC_3G in node.devices
        entry = node.checkpoint().claims[ref.uid]
        assert entry.phase == ckpt.ClaimPhase.COMPLETED
        (record,) = entry.mig
        assert (record.device, record.gpu_instance_id, record.compute_instance_id, record.uuid) == (
            SLICE_3G, instance.gpu_instance_id, instance.compute_instance_id, instance.uuid
        )
        assert node.spec(ref) == spec
        described = CreatedDevices(node.devices, p.steps.placements, lambda: entry.mig)
        assert described[SLICE_3G].uuid == instance.uuid, "the claim's status names the instance"
        retry = (await p.prepare([ref]))[ref.uid]
        assert retry == ClaimResult(entry.devices), "the kubelet's retry: as before"
        p = await node.restart()  # the new checkpoint says it from now on
        assert node.listings == 0 and not any(d.startswith("gpu-0-mig-3g71gb") for d in node.devices)
        assert await p.unprepare([ref]) == {ref.uid: ClaimResult()}
        assert dynamic(node) == [], "Unprepare destroys the adopted instance"
        assert [(x.gpu, x.placement) for x in node.live()] == [(1, 4)], "the static instance is untouched"
        assert node.spec(ref) is None and node.checkpoint().claims == {}

    asyncio.run(run())


def test_a_lost_checkpoint_and_no_instance_at_the_placement_adopts_nothing(tmp_path: Path) -> None:
    async def run() -> None:
        node = MigNode(tmp_path)
        p = await node.restart()
        ref = node.add("a", SLICE_3G)
        assert (await p.prepare([ref]))[ref.uid].error is None
        (record,) = node.checkpoint().claims[ref.uid].mig
        assert record.gpu_instance_id is not None and record.compute_instance_id is not None
        by_hand = MigInstances(node.nvml())
        by_hand.destroy(record.parent_uuid, record.gpu_instance_id, record.compute_instance_id)
        other = node.add("b", "gpu-0-mig-3g-71gb-9-0")
        assert (await p.prepare([other]))[other.uid].error is None
        lose_checkpoint(node, "corrupt")
        p = await node.restart()
        claims = node.checkpoint().claims
        assert ref.uid not in claims, "its device is gone: not adopted (as any claim that cannot be)"
        assert node.spec(ref) is not None, "its files are kept for the kubelet's Unprepare"
        assert claims[other.uid].mig[0].created, "the other claim's instance is adopted"
        assert await p.unprepare([ref]) == {ref.uid: ClaimResult()} and node.spec(ref) is None
        assert dynamic(node) == [(0, profile_id("3g.71gb"), 0)]
        assert await p.unprepare([other]) == {other.uid: ClaimResult()} and dynamic(node) == []

    asyncio.run(run())


def test_a_corrupt_checkpoint_says_the_api_server_is_asked_only_where_it_is(tmp_path: Path) -> None:
    """A node with no MIG instance on a dynamic GPU has nothing to ask the API server about; one
    with a claim's instance to adopt asks, and says so."""

    async def run() -> None:
        plain = tmp_path / "plain"
        path = ckpt.checkpoint_path(plain / "state")
        path.parent.mkdir(parents=True)
        path.write_text('{"version": 1, "claims": {')
        asked: list[int] = []

        async def listed() -> list[dict[str, Any]] | None:
            asked.append(1)
            return []

        paths = StartPaths(path, BOOT, DRIVER, NODE, plain / "cdi")
        with structlog.testing.capture_logs() as logs:
            assert await instances_at_start(discover("hgx-h200"), paths, listed) == []
        assert asked == [] and not [e for e in logs if "API server" in e["event"]], logs

        node = MigNode(tmp_path / "mig")
        p = await node.restart()
        ref = node.add("a", SLICE_3G)
        assert (await p.prepare([ref]))[ref.uid].error is None
        lose_checkpoint(node, "corrupt")
        with structlog.testing.capture_logs() as logs:
            await node.restart()
        assert node.listings == 1
        assert [e for e in logs if "asking the API server" in e["event"]], logs

    asyncio.run(run())
