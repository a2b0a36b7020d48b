"""NodePreparer without an API server: recovery after crashes and corruption, idempotency, conflicts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from dra_driver import cdi
from dra_driver.devices import node_devices
from dra_driver.driver_root import simulated_driver_files
from dra_driver.gpu import discover
from dra_driver.mps import MpsControl
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.claims import ClaimRef, ClaimRejected
from dra_driver.plugin.state import NodePreparer

DRIVER = "gpu.dra-driver.dev"
NODE = "node-a"
BOOT = "boot-1"


def _claim(ref: ClaimRef, device: str, config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    devices: dict[str, Any] = {
        "results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}]
    }
    if config:
        devices["config"] = config
    return {
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
        "status": {"allocation": {"devices": devices}},
    }


class Node:
    """A simulated 4-GPU node's preparer with claims served from a dict instead of the API server."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.claims: dict[str, dict[str, Any]] = {}
        self.inventory = discover("l4x4")

    def preparer(self) -> NodePreparer:
        async def fetch(ref: ClaimRef) -> dict[str, Any]:
            return self.claims[ref.uid]

        return NodePreparer(
            driver=DRIVER,
            pool=NODE,
            devices=node_devices(self.inventory),
            fetch_claim=fetch,
            driver_files=simulated_driver_files([g.minor for g in self.inventory.gpus]),
            cdi_dir=self.root / "cdi",
            data_dir=self.root / "data",
            boot_id=BOOT,
            mps=MpsControl(self.root / "mps", "/nonexistent-driver-root"),
        )

    def add(self, name: str, device: str, config: list[dict[str, Any]] | None = None) -> ClaimRef:
        ref = ClaimRef("ns", name, f"uid-{name}")
        self.claims[ref.uid] = _claim(ref, device, config)
        return ref

    def specs(self) -> set[str]:
        return set(cdi.claim_uids_in(self.root / "cdi", DRIVER))


async def _started(node: Node) -> NodePreparer:
    p = node.preparer()
    await p.recover()
    return p


def test_prepare_is_idempotent_and_unprepare_cleans_up(tmp_path: Path) -> None:
    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        ref = node.add("a", "gpu-2")
        first = await p.prepare(ref)
        assert [d.device for d in first] == ["gpu-2"]
        assert await p.prepare(ref) == first
        assert node.specs() == {ref.uid}
        await p.unprepare(ref)
        await p.unprepare(ref)
        assert node.specs() == set() and p.checkpoint.claims == {}

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
        await p.prepare(done)
        await p.prepare(gone_spec)
        cdi.remove_claim_spec(tmp_path / "cdi", DRIVER, gone_spec.uid)  # e.g. someone cleaned /var/run/cdi
        cp = ckpt.with_started(p.checkpoint, "ns", "half", interrupted.uid, [])
        ckpt.save(p.checkpoint_path, cp)  # crash after `started`
        orphan = cdi.build_claim_spec(DRIVER, "uid-orphan", [p.devices["gpu-3"]], p.driver_files)
        cdi.write_spec(tmp_path / "cdi", orphan)  # crash after the spec of an entry never saved

        restarted = await _started(node)
        assert set(restarted.checkpoint.claims) == {done.uid, gone_spec.uid}
        assert node.specs() == {done.uid, gone_spec.uid}
        assert await restarted.prepare(interrupted)  # redone from scratch
        assert node.specs() == {done.uid, gone_spec.uid, interrupted.uid}

    asyncio.run(run())


def test_a_corrupt_checkpoint_is_moved_aside_and_serving_goes_on(tmp_path: Path) -> None:
    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        await p.prepare(node.add("a", "gpu-0"))
        p.checkpoint_path.write_text('{"version": 1, "checksum": "sha256:00", "payload": {}}')
        restarted = await _started(node)
        assert restarted.checkpoint.claims == {}
        assert list((tmp_path / "data").glob("checkpoint.json.corrupt-*"))
        assert node.specs() == set(), "a spec without an entry is removed, so no stale device stays visible"
        again = await restarted.prepare(ClaimRef("ns", "a", "uid-a"))
        assert [d.device for d in again] == ["gpu-0"]

    asyncio.run(run())


def test_a_device_prepared_for_one_claim_is_refused_to_another(tmp_path: Path) -> None:
    async def run() -> None:
        node = Node(tmp_path)
        p = await _started(node)
        await p.prepare(node.add("first", "gpu-1"))
        with pytest.raises(ClaimRejected, match="already prepared for claim ns/first"):
            await p.prepare(node.add("second", "gpu-1"))
        assert node.specs() == {"uid-first"}

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
        with pytest.raises(ClaimRejected, match="Teleport"):
            await p.prepare(node.add("bad", "gpu-0", config))
        assert node.specs() == set() and p.checkpoint.claims == {}

    asyncio.run(run())
