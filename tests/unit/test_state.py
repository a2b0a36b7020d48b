"""NodePreparer without an API server: recovery after crashes and unreadable state, idempotency,
conflicts, batches, and two instances over one data dir."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.cdi.builders import build_claim_spec
from dra_driver.cdi.files import claim_spec_path, claim_uids_in, remove_claim_spec, write_spec
from dra_driver.devices import node_devices
from dra_driver.driver_root import simulated_driver_files
from dra_driver.gpu import discover
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.claims import ClaimGone, ClaimRef, ClaimRejected
from dra_driver.plugin.lock import exclusive
from dra_driver.plugin.state import ClaimResult, NodePreparer
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.policy import Sharing
from tests.harness.checkpoints import with_started
from tests.harness.claims_in_memory import with_spec
from tests.harness.objects import wait_for_async

NODE = "node-a"
BOOT = "boot-1"


def _claim(
    ref: ClaimRef, device: str, config: list[dict[str, Any]] | None = None, driver: str = DRIVER
) -> dict[str, Any]:
    devices: dict[str, Any] = {
        "results": [{"request": "gpu", "driver": driver, "pool": NODE, "device": device}]
    }
    if config:
        devices["config"] = config
    return with_spec({
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
        "status": {"allocation": {"devices": devices}},
    })


class Node:
    """A simulated 4-GPU node's preparer with claims served from a dict instead of the API server."""

    def __init__(self, root: Path, driver: str = DRIVER, state_dir: Path | None = None) -> None:
        self.root = root
        self.driver = driver
        self.state_dir = state_dir or root / "state"
        self.claims: dict[str, dict[str, Any]] = {}
        self.claims_unanswerable: set[str] = set()  # reads of these time out
        self.api_up = True
        self.reads = 0
        self.lists = 0
        self.inventory = discover("l4x4")

    async def read(self, refs: Sequence[ClaimRef]) -> dict[str, dict[str, Any] | ClaimRejected]:
        self.reads += len(refs)
        return {
            r.uid: ClaimRejected(f"timed out reading claim {r.name}") if r.uid in self.claims_unanswerable
            else self.claims.get(r.uid) or ClaimGone(f"claim {r.name} does not exist") for r in refs
        }

    async def allocated_here(self, driver: str, pool: str) -> list[dict[str, Any]] | None:
        self.lists += 1
        return list(self.claims.values()) if self.api_up else None

    def preparer(self) -> NodePreparer:
        return NodePreparer(
            driver=self.driver,
            pool=NODE,
            devices=node_devices(self.inventory),
            claims=self,
            driver_files=simulated_driver_files([g.minor for g in self.inventory.gpus]),
            cdi_dir=self.root / "cdi",
            state_dir=self.state_dir,
            sharing=Sharing(
                self.driver, NODE, MpsControl(self.root / "mps" / self.driver, "/nonexistent-driver-root")
            ),
            boot_id=BOOT,
        )

    def add(self, name: str, device: str, config: list[dict[str, Any]] | None = None) -> ClaimRef:
        ref = ClaimRef("ns", name, f"uid-{name}")
        self.claims[ref.uid] = _claim(ref, device, config, self.driver)
        return ref

    def specs(self) -> set[str]:
        return set(claim_uids_in(self.root / "cdi", self.driver))


async def _started(node: Node) -> NodePreparer:
    node.state_dir.mkdir(parents=True, exist_ok=True)
    p = node.preparer()
    await p.recover()
    return p


async def prepared(p: NodePreparer, ref: ClaimRef) -> list[str]:
    """The devices prepared for `ref`; fails the test with the plugin's error otherwise."""
    result = (await p.prepare([ref]))[ref.uid]
    assert result.error is None, result.error
    return [d.device for d in result.devices]


async def refused(p: NodePreparer, ref: ClaimRef) -> str:
    result = (await p.prepare([ref]))[ref.uid]
    assert result.error is not None and not result.devices
    return result.error


def test_prepare_is_idempotent_and_unprepare_cleans_up(tmp_path: Path) -> None:
    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        ref = node.add("a", "gpu-2")
        first = await p.prepare([ref])
        assert [d.device for d in first[ref.uid].devices] == ["gpu-2"]
        reads = node.reads
        assert await p.prepare([ref]) == first
        assert node.reads == reads, "a prepared claim is answered from the checkpoint, without an API read"
        assert node.specs() == {ref.uid}
        assert await p.unprepare([ref]) == {ref.uid: ClaimResult()}
        assert await p.unprepare([ref]) == {ref.uid: ClaimResult()}
        assert node.specs() == set() and p.read_checkpoint().claims == {}

    asyncio.run(run())


def test_restart_recovers_every_half_done_state(tmp_path: Path) -> None:
    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        done, gone_spec, interrupted = (
            node.add("done", "gpu-0"),
            node.add("gone", "gpu-1"),
            node.add("half", "gpu-2"),
        )
        await prepared(p, done)
        await prepared(p, gone_spec)
        remove_claim_spec(tmp_path / "cdi", DRIVER, gone_spec.uid)  # e.g. someone cleaned /var/run/cdi
        cp = with_started(p.read_checkpoint(), "ns", "half", interrupted.uid, [])
        ckpt.save(p.steps.checkpoint_path, cp)  # crash after `started`
        orphan = build_claim_spec(DRIVER, "uid-orphan", [p.steps.devices["gpu-3"]], p.steps.driver_files)
        write_spec(tmp_path / "cdi", orphan)  # a spec whose claim this node never recorded

        restarted = await _started(node)
        assert set(restarted.read_checkpoint().claims) == {done.uid, gone_spec.uid}
        assert node.specs() == {done.uid, gone_spec.uid}
        assert await prepared(restarted, interrupted) == ["gpu-2"]  # redone from scratch
        assert node.specs() == {done.uid, gone_spec.uid, interrupted.uid}

    asyncio.run(run())


def _valid_doc(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


WRONG_SHAPE = {"bootId": BOOT, "claims": "none"}
UNREADABLE = {
    "a directory": lambda path: (path.unlink(), path.mkdir()),
    "truncated": lambda path: path.write_bytes(path.read_bytes()[:40]),
    "empty object": lambda path: path.write_text("{}"),
    "not JSON": lambda path: path.write_bytes(b"\x00\xff garbage"),
    "wrong checksum": lambda path: path.write_text(path.read_text().replace('"gpu-0"', '"gpu-3"')),
    "wrong shape": lambda path: path.write_text(
        json.dumps({**_valid_doc(path), "payload": WRONG_SHAPE, "checksum": ckpt._checksum(WRONG_SHAPE)})
    ),
}


@pytest.mark.parametrize("damage", sorted(UNREADABLE))
def test_an_unreadable_checkpoint_keeps_what_running_pods_use(tmp_path: Path, damage: str) -> None:
    """Moved aside; specs of claims still allocated here are adopted, only those of gone claims go."""

    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        running, finished = node.add("running", "gpu-0"), node.add("finished", "gpu-1")
        await prepared(p, running)
        await prepared(p, finished)
        del node.claims[finished.uid]  # deleted while this plugin was down
        UNREADABLE[damage](p.steps.checkpoint_path)

        restarted = await _started(node)
        assert list((tmp_path / "state").glob("checkpoint.json.corrupt-*")), "moved aside, for a person"
        assert node.specs() == {running.uid}, "the running pod keeps its spec; the gone claim's is removed"
        entry = restarted.read_checkpoint().claims[running.uid]
        assert entry.phase == ckpt.ClaimPhase.COMPLETED and [d.device for d in entry.devices] == ["gpu-0"]
        reads = node.reads
        assert await prepared(restarted, running) == ["gpu-0"]
        assert node.reads == reads, "adopted: answered from the new checkpoint"
        error = await refused(restarted, node.add("thief", "gpu-0"))
        assert "already prepared for claim ns/running" in error, "the double-allocation guard knows it again"

    asyncio.run(run())


def test_an_unreadable_checkpoint_and_no_api_server_removes_nothing(tmp_path: Path) -> None:
    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        a, b = node.add("a", "gpu-0"), node.add("b", "gpu-1")
        await prepared(p, a)
        await prepared(p, b)
        p.steps.checkpoint_path.write_text("{}")
        node.api_up = False
        restarted = await _started(node)
        assert node.specs() == {a.uid, b.uid}, "when nobody can say a claim is gone, nothing is removed"
        assert await restarted.unprepare([b]) == {b.uid: ClaimResult()}  # the kubelet's call still cleans up
        assert node.specs() == {a.uid}

    asyncio.run(run())


@pytest.mark.parametrize("api_up", [True, False])
def test_a_wiped_state_dir_keeps_what_running_pods_use(tmp_path: Path, api_up: bool) -> None:
    """No checkpoint at all, but this boot's specs on disk (the state dir was wiped, or moved
    by a changed --state-dir): the API server decides, as for an unreadable one."""

    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        running, finished = node.add("running", "gpu-0"), node.add("finished", "gpu-1")
        await prepared(p, running)
        await prepared(p, finished)
        del node.claims[finished.uid]
        p.steps.checkpoint_path.unlink()
        node.api_up = api_up

        restarted = await _started(node)
        if not api_up:
            assert node.specs() == {running.uid, finished.uid}, "nobody can say a claim is gone"
            return
        assert node.specs() == {running.uid}, "the running pod keeps its spec; the gone claim's is removed"
        assert [d.device for d in restarted.read_checkpoint().claims[running.uid].devices] == ["gpu-0"]
        assert "already prepared for claim ns/running" in await refused(restarted, node.add("thief", "gpu-0"))

    asyncio.run(run())


def test_a_first_start_and_a_restart_ask_the_api_server_nothing(tmp_path: Path) -> None:
    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        await prepared(p, node.add("a", "gpu-0"))
        await _started(node)
        assert node.lists == 0, "only a lost or unreadable checkpoint with specs on disk needs the list"
        p.steps.checkpoint_path.unlink()
        await _started(node)
        assert node.lists == 1

    asyncio.run(run())


def test_a_checkpoint_from_a_newer_build_stops_start_and_is_left_intact(tmp_path: Path) -> None:
    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        ref = node.add("a", "gpu-0")
        await prepared(p, ref)
        doc = _valid_doc(p.steps.checkpoint_path)
        doc.update(version=ckpt.FORMAT_VERSION + 1, writtenBy="gpu-dra-driver 2.0.0")
        p.steps.checkpoint_path.write_text(json.dumps(doc))
        before = p.steps.checkpoint_path.read_bytes()
        with pytest.raises(ckpt.CheckpointFromNewerVersion, match=r"gpu-dra-driver 2\.0\.0"):
            await _started(node)
        assert p.steps.checkpoint_path.read_bytes() == before and node.specs() == {ref.uid}
        assert not list((tmp_path / "state").glob("checkpoint.json.corrupt-*"))
        # the old instance of an update keeps serving, but refuses to touch the newer state
        assert "gpu-dra-driver 2.0.0" in await refused(p, node.add("b", "gpu-1"))
        assert p.steps.checkpoint_path.read_bytes() == before

    asyncio.run(run())


def test_a_device_prepared_for_one_claim_is_refused_to_another(tmp_path: Path) -> None:
    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        await prepared(p, node.add("first", "gpu-1"))
        assert "already prepared for claim ns/first" in await refused(p, node.add("second", "gpu-1"))
        assert node.specs() == {"uid-first"}

    asyncio.run(run())


@pytest.mark.parametrize("how", ["deleted", "re-created", "allocated elsewhere"])
def test_a_device_whose_claim_the_api_server_released_is_taken_over(tmp_path: Path, how: str) -> None:
    """`kubectl delete pod --force --grace-period=0`: the pod and then its claim are gone before
    the kubelet unprepares it, and the scheduler gives its GPU to the next pod. That pod is
    prepared at once, not told to delete a pod that no longer exists; the old claim's spec
    goes with it, and the kubelet's late Unprepare of it still answers."""

    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        first = node.add("first", "gpu-1")
        await prepared(p, first)
        if how == "deleted":
            del node.claims[first.uid]
        elif how == "re-created":
            node.claims[first.uid] = {**node.claims[first.uid], "metadata": {
                "namespace": "ns", "name": "first", "uid": "uid-first-again"}}
        else:
            node.add("first", "gpu-3")  # the same claim, now holding another GPU
        second = node.add("second", "gpu-1")
        assert await prepared(p, second) == ["gpu-1"]
        assert node.specs() == {second.uid}
        assert set(p.read_checkpoint().claims) == {second.uid}
        assert (await p.unprepare([first]))[first.uid].error is None

    asyncio.run(run())


def test_a_holder_the_api_server_cannot_answer_for_is_kept(tmp_path: Path) -> None:
    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        first = node.add("first", "gpu-1")
        await prepared(p, first)
        answer = node.claims.pop(first.uid)
        node.claims_unanswerable = {first.uid}
        assert "already prepared for claim ns/first" in await refused(p, node.add("second", "gpu-1"))
        assert node.specs() == {first.uid} and answer

    asyncio.run(run())


def test_one_call_answers_each_claim_on_its_own(tmp_path: Path) -> None:
    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        a, b, same = node.add("a", "gpu-0"), node.add("b", "gpu-1"), node.add("same", "gpu-0")
        missing, bad = ClaimRef("ns", "missing", "uid-missing"), ClaimRef("ns", "../x", "uid-bad")
        results = await p.prepare([a, b, same, missing, bad])
        assert [d.device for d in results[a.uid].devices] == ["gpu-0"]
        assert [d.device for d in results[b.uid].devices] == ["gpu-1"]
        assert "already prepared for claim ns/a" in str(results[same.uid].error)
        assert "does not exist" in str(results[missing.uid].error)
        assert "not a valid Kubernetes name" in str(results[bad.uid].error)
        assert node.specs() == {a.uid, b.uid}

    asyncio.run(run())


def test_two_instances_on_one_data_dir_see_each_others_work(tmp_path: Path) -> None:
    """Nothing is cached across calls: what one instance did, the other knows at its next call."""

    async def run() -> None:
        node = Node(tmp_path)
        old, new = await _started(node), await _started(node)
        a, b = node.add("a", "gpu-0"), node.add("b", "gpu-1")
        await prepared(old, a)
        await prepared(new, b)
        assert "already prepared for claim ns/a" in await refused(new, node.add("c", "gpu-0"))
        assert await new.unprepare([a]) == {a.uid: ClaimResult()}
        assert set(old.read_checkpoint().claims) == {b.uid}
        await old.recover()  # e.g. the old pod restarted: it must not undo the new one's claim
        assert node.specs() == {b.uid} and set(new.read_checkpoint().claims) == {b.uid}

    asyncio.run(run())


def test_an_invalid_sharing_config_is_refused_with_what_to_fix(tmp_path: Path) -> None:
    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        config = [
            {
                "source": "FromClaim",
                "requests": ["gpu"],
                "opaque": {
                    "driver": DRIVER,
                    "parameters": {
                        "apiVersion": "gpu.dra-driver.dev/v1alpha1",
                        "kind": "GpuConfig",
                        "sharing": {"strategy": "Teleport"},
                    },
                },
            }
        ]
        assert "Teleport" in await refused(p, node.add("bad", "gpu-0", config))
        assert node.specs() == set() and p.read_checkpoint().claims == {}

    asyncio.run(run())


@contextlib.contextmanager
def _held_by_another_instance(lock: Path) -> Iterator[threading.Event]:
    """The lock taken by a thread (as another plugin instance would) until the event it yields
    is set (or the block ends)."""
    held, release = threading.Event(), threading.Event()

    def other_instance() -> None:
        with exclusive(lock):
            held.set()
            release.wait(60)

    holder = threading.Thread(target=other_instance)
    holder.start()
    held.wait()
    try:
        yield release
    finally:
        release.set()
        holder.join()


def test_a_spec_from_an_earlier_boot_is_never_adopted(tmp_path: Path) -> None:
    """A persistent CDI dir can keep specs across a reboot; their pods died with it."""

    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        old = node.add("old", "gpu-0")
        await prepared(p, old)
        spec = claim_spec_path(tmp_path / "cdi", DRIVER, old.uid)
        before_boot = ckpt.boot_time() - 60
        os.utime(spec, (before_boot, before_boot))
        p.steps.checkpoint_path.write_text("{}")  # e.g. torn by the power loss that ended that boot
        restarted = await _started(node)
        assert node.specs() == set() and restarted.read_checkpoint().claims == {}

    asyncio.run(run())


def test_a_lock_held_by_the_other_instance_never_blocks_the_event_loop(tmp_path: Path) -> None:
    """The section then waits in a thread; the loop (health, probes, other claims) runs on."""

    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        ref = node.add("a", "gpu-0")
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)  # not a wait: a tick counts each turn the loop gets
                ticks += 1

        with _held_by_another_instance(p.steps.lock_path) as release:
            ticking = asyncio.create_task(ticker())
            preparing = asyncio.create_task(prepared(p, ref))
            # The loop turns while the prepare waits for the other instance's section ...
            await wait_for_async("ten turns of the loop", lambda: ticks >= 10,
                                 detail=lambda: (ticks, preparing))
            assert not preparing.done(), "the prepare waited for the other instance's section"
            # ... and the prepare goes on once that section ends.
            release.set()
            assert await preparing == ["gpu-0"]
            ticking.cancel()

    asyncio.run(run())


OTHER_DRIVER = "gpu.other.example.com"


def _disk(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `root` with its content and mtime."""
    return {
        str(f.relative_to(root)): (f.read_bytes(), f.stat().st_mtime_ns)
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def test_a_checkpoint_of_another_driver_stops_start_and_nothing_on_disk_changes(tmp_path: Path) -> None:
    """Two releases pointed at one state dir: the second plugin refuses to start, naming both
    drivers, and neither adopts, rewrites nor removes anything of the first."""

    async def run() -> None:
        first = Node(tmp_path)
        p = await _started(first)
        ref = first.add("a", "gpu-0")
        await prepared(p, ref)
        before = _disk(tmp_path)

        second = Node(tmp_path, OTHER_DRIVER, state_dir=first.state_dir)
        second.add("b", "gpu-0")
        with pytest.raises(ckpt.CheckpointOfAnotherDriver) as info:
            await _started(second)
        assert DRIVER in str(info.value) and OTHER_DRIVER in str(info.value)
        assert "--state-dir" in str(info.value), "it says what to change"
        assert _disk(tmp_path) == before, "nothing on disk changed"
        assert second.lists == 0, "it did not try to adopt"

    asyncio.run(run())


def test_two_drivers_on_one_node_never_touch_each_others_state(tmp_path: Path) -> None:
    """State dirs per driver, one CDI dir: a device of the same name prepared by both drivers, a
    corrupted checkpoint of one, a wiped state dir of the other, restarts: each driver's specs
    stay as they were, whatever the other's recovery does."""

    async def run() -> None:
        a_node = Node(tmp_path, DRIVER, state_dir=tmp_path / "state-a")
        b_node = Node(tmp_path, OTHER_DRIVER, state_dir=tmp_path / "state-b")
        a, b = await _started(a_node), await _started(b_node)
        a_ref, b_ref = a_node.add("a", "gpu-0"), b_node.add("b", "gpu-0")
        assert await prepared(a, a_ref) == ["gpu-0"]
        assert await prepared(b, b_ref) == ["gpu-0"], "the other driver's gpu-0 is no conflict"
        a_spec = claim_spec_path(tmp_path / "cdi", DRIVER, a_ref.uid)
        b_spec = claim_spec_path(tmp_path / "cdi", OTHER_DRIVER, b_ref.uid)
        a_before = (a_spec.read_bytes(), a_spec.stat().st_mtime_ns)

        b.steps.checkpoint_path.write_text("{}")  # corrupted: B adopts from the API server
        b = await _started(b_node)
        assert (a_spec.read_bytes(), a_spec.stat().st_mtime_ns) == a_before, "B's recovery left A's spec"
        assert b_spec.exists() and set(b.read_checkpoint().claims) == {b_ref.uid}
        b_before = (b_spec.read_bytes(), b_spec.stat().st_mtime_ns)

        a.steps.checkpoint_path.unlink()  # A's state dir wiped: A adopts its own
        a = await _started(a_node)
        assert (b_spec.read_bytes(), b_spec.stat().st_mtime_ns) == b_before, "A's recovery left B's spec"
        assert a_spec.exists() and set(a.read_checkpoint().claims) == {a_ref.uid}
        assert a.read_checkpoint().driver == DRIVER and b.read_checkpoint().driver == OTHER_DRIVER

        await a.unprepare([a_ref])
        assert not a_spec.exists() and b_spec.exists(), "A's unprepare removes A's spec only"

    asyncio.run(run())
