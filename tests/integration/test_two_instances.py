"""Two plugin instances on one node, as during every rolling update, with kill -9 at random points.

Both serve at once over one kubelet dir, data dir and CDI dir (socket names carry each
pod's UID, as the DaemonSet sets them). A stream of Prepare and Unprepare calls goes to
either instance at random while one of them is killed -9 now and then and started again.
A model of what the kubelet was told says which claims are prepared; afterwards the
checkpoint, the CDI specs and the model must agree, no claim the kubelet was told is
prepared may be lost, and no device may be prepared for two claims at once. Claims are
allocated by hand (4 GPUs, 8 claims, two per GPU), so the double-allocation guard must hold
ACROSS the instances. Half of the claims ask for MPS, so each has an MPS control daemon (a
stand-in for `nvidia-cuda-mps-control` in the driver root) that must run exactly while its
claim is prepared.
"""

from __future__ import annotations

import random
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client

from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.sockets import plugin_paths
from dra_driver.sharing.mps.daemon import MpsControl
from tests.harness.claims import allocated_claim
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.fake_mps import shared_mps_root
from tests.harness.kubelet import ClaimName, KubeletSide
from tests.harness.objects import create_device_class, create_node, sync_request, wait_for

PROFILE = "l4x4"  # gpu-0..gpu-3
CLAIMS = 8
MPS = {"apiVersion": "gpu.dra-driver.dev/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}
CALLS = 240
KILLS = 8
SEED = 20261202


@pytest.fixture
def shared_root() -> Iterator[Path]:
    with shared_mps_root("dra2-") as path:
        yield path


class Instance:
    """One plugin pod of the update: its own rolling-update UID and log, the node's shared dirs."""

    def __init__(self, name: str, node: str, kubeconfig: Path, shared: Path, publish: bool = False) -> None:
        self.uid = f"pod-{name}"
        args = ("--rolling-update-uid", self.uid, "--driver-root", str(shared / "driver"))
        args += () if publish else ("--no-publish-slices",)
        self.proc = DriverProcess(node, PROFILE, kubeconfig, shared, extra_args=args)
        self.kubelet: KubeletSide | None = None

    def start(self) -> None:
        # both instances append to <root>/plugin.log, as both pods' logs would reach one collector
        self.proc.start(wait=False)
        socket = plugin_paths(self.proc.kubelet_dir, DRIVER, self.uid).registration_socket

        def connected() -> KubeletSide | None:
            self.proc.check_alive()
            try:  # the socket file of a killed predecessor stays until the new one binds
                return KubeletSide(socket, timeout=5) if socket.exists() else None
            except grpc.RpcError:
                return None

        self.kubelet = wait_for(f"instance {self.uid} serving", connected, timeout=60)
        self.kubelet.timeout = 45

    def kill(self) -> None:
        if self.kubelet is not None:
            self.kubelet.close()
            self.kubelet = None
        self.proc.stop(signal.SIGKILL)


def _state(data_dir: Path, cdi_dir: Path) -> tuple[dict[str, ckpt.ClaimEntry], set[str]]:
    entries = ckpt.load(ckpt.checkpoint_path(data_dir), ckpt.read_boot_id()).checkpoint.claims
    specs = {p.stem.split("_", 1)[1] for p in cdi_dir.glob(f"{DRIVER}-gpu_*.json")}
    return dict(entries), specs


def test_two_instances_with_random_kills_keep_one_consistent_state(
    control_plane: ControlPlane, api: client.ApiClient, namespace: str, unique: str, shared_root: Path
) -> None:
    node = f"update-{unique}"
    create_node(api, node)
    device_class = f"two-{unique}"
    create_device_class(api, device_class, f'device.driver == "{DRIVER}"')
    claims: list[tuple[ClaimName, str]] = []
    for i in range(CLAIMS):
        results = [{"pool": node, "device": f"gpu-{i % 4}"}]
        config = MPS if i < 4 else None
        claim = allocated_claim(api, namespace, f"c{i}", results, device_class, parameters=config)
        m = claim["metadata"]
        claims.append((ClaimName(m["namespace"], m["name"], m["uid"]), f"gpu-{i % 4}"))

    instances = [Instance(n, node, control_plane.kubeconfig, shared_root) for n in ("old", "new")]
    for inst in instances:
        inst.start()
    rng = random.Random(SEED)
    prepared: dict[str, str] = {}  # claim UID -> device, as the kubelet was told
    stats = {"prepare": 0, "unprepare": 0, "refused": 0, "failed-by-kill": 0, "kills": 0, "mps-checked": 0}

    def call(inst: Instance, op: str, ref: ClaimName) -> Any:
        assert inst.kubelet is not None
        answer = (inst.kubelet.prepare if op == "prepare" else inst.kubelet.unprepare)(ref)
        return answer.claims[ref.uid]

    mps = MpsControl(shared_root / "mps", shared_root / "driver")
    mps_claims = {r.uid for r, _ in claims[:4]}

    def agree(when: str) -> None:
        """Checkpoint, CDI specs and MPS daemons say what the kubelet was told, and nothing else."""
        entries, specs = _state(instances[0].proc.state_dir, instances[0].proc.cdi_dir)
        assert set(entries) == set(prepared), f"{when}: the checkpoint holds exactly the prepared claims"
        completed = ckpt.ClaimPhase.COMPLETED
        assert all(e.phase == completed for e in entries.values()), f"{when}: a half-done entry"
        assert specs == set(prepared), f"{when}: a spec for each prepared claim and for no other"
        assert mps.claim_uids() == set(prepared) & mps_claims, f"{when}: a daemon for each prepared MPS claim"
        assert all(mps.is_running(uid) for uid in mps.claim_uids()), f"{when}: an MPS daemon died"
        stats["mps-checked"] += len(mps.claim_uids())

    kill_at = sorted(rng.sample(range(10, CALLS - 10), KILLS))
    try:
        for n in range(CALLS):
            ref, device = rng.choice(claims)
            op = "unprepare" if ref.uid in prepared else "prepare"
            target = rng.choice([i for i in instances if i.kubelet is not None])
            killer: threading.Timer | None = None
            if kill_at and n == kill_at[0]:
                kill_at.pop(0)
                victim = rng.choice(instances)
                killer = threading.Timer(rng.uniform(0.0, 0.02), victim.kill)  # mid-call, or just before
                killer.start()
                stats["kills"] += 1
            try:
                answer = call(target, op, ref)
            except (grpc.RpcError, ValueError, AssertionError):  # killed mid-call, or just before
                # the kubelet retries a failed call on the instance that is still there
                stats["failed-by-kill"] += 1
                if killer is not None:
                    killer.join()
                survivor = next(i for i in instances if i.kubelet is not None)
                answer = call(survivor, op, ref)
            stats[op] += 1
            holder = next((uid for uid, d in prepared.items() if d == device), None)
            if op == "unprepare":
                assert answer.error == "", answer.error
                prepared.pop(ref.uid)
            elif holder is None:
                assert answer.error == "", answer.error
                assert [d.device_name for d in answer.devices] == [device]
                prepared[ref.uid] = device
            else:
                assert "already prepared for claim" in answer.error, f"{device} given to two claims: {answer}"
                stats["refused"] += 1
            if killer is not None:
                killer.join()
                agree(f"after kill {stats['kills']}")  # the survivor alone, mid-update
                for inst in instances:
                    if inst.kubelet is None:
                        inst.start()

        agree("at the end")
        # kill both, start one: recovery keeps every prepared claim and its spec
        for inst in instances:
            inst.kill()
        instances[1].start()
        assert _state(instances[0].proc.state_dir, instances[0].proc.cdi_dir)[1] == set(prepared)
        for uid in list(prepared):
            ref = next(r for r, _ in claims if r.uid == uid)
            assert call(instances[1], "unprepare", ref).error == ""
        assert _state(instances[0].proc.state_dir, instances[0].proc.cdi_dir) == ({}, set())
        assert mps.claim_uids() == set() and not any(mps.daemon_pids(uid) for uid in mps_claims)
    finally:
        for inst in instances:
            inst.kill()
    print(f"two instances: {CALLS} calls, {stats}")
    assert stats["kills"] == KILLS and stats["refused"] > 0 and stats["mps-checked"] > 0


def test_only_one_instance_publishes_and_the_other_takes_over(
    control_plane: ControlPlane, api: client.ApiClient, unique: str, shared_root: Path
) -> None:
    node = f"lease-{unique}"
    create_node(api, node)
    old, new = (
        Instance(n, node, control_plane.kubeconfig, shared_root, publish=True) for n in ("old", "new")
    )
    slices = "/apis/resource.k8s.io/v1/resourceslices"

    def node_slices() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = sync_request(
            api, "GET", slices, query={"fieldSelector": f"spec.nodeName={node}"}
        )["items"]
        return items

    try:
        old.start()
        wait_for("the node's slices", lambda: node_slices() or None, timeout=30)
        new.start()

        def new_one_waits() -> str | None:  # the log (both instances') once the new one has decided
            log = old.proc.log_path.read_text()
            return log if "another instance publishes this node's slices" in log else None

        log = wait_for("the new instance to leave publishing to the old one", new_one_waits, timeout=30,
                       detail=lambda: old.proc.log_path.read_text()[-3000:])
        assert log.count("publishing this node's ResourceSlices") == 1, "exactly one instance publishes"
        old.kill()
        for s in node_slices():
            sync_request(api, "DELETE", f"{slices}/{s['metadata']['name']}")
        wait_for("the new instance to repair the deleted slices", lambda: node_slices() or None, timeout=30)
    finally:
        old.kill()
        new.kill()
        # other tests' claims must not be scheduled onto this node's devices
        for s in node_slices():
            sync_request(api, "DELETE", f"{slices}/{s['metadata']['name']}")
        sync_request(api, "DELETE", f"/api/v1/nodes/{node}")
