"""Dynamic MIG on a real node: the instance is made when the pod's claim is prepared, the
container gets exactly its caps nodes and its MIG UUID, and it is destroyed when the pod goes;
a plugin killed between creating an instance and recording it leaves no orphan and no lost
claim once it is back.

One node of its own (kubelet + containerd + runc) with the simulated `hgx-h200-mig` profile
(GPU 0: an empty H200 in MIG mode; GPU 1: in MIG mode with a static 3g.71gb at slices 4-7;
GPU 2: a whole H200) and `dra-driver kubelet-plugin --dynamic-mig`. The simulated GPUs keep
their MIG instances in `<state dir>/simulated-mig.json`, read here as `nvidia-smi mig -lgi`
would be on a GPU. The claim is deploy/examples/mig/01-slice-3g-71gb.yaml as shipped.

The kill: the plugin is started with DRA_DRIVER_FAULT=prepare-after-mig-create, the seam
its crash-safety tests already use, so it calls os._exit(137) (what kill -9 leaves: no
finally, no flush) right after NVML made the instance and before the checkpoint records its
ids. A real SIGKILL from outside cannot be aimed between those two steps (they are
microseconds apart), so the hook is the only way to hit that window every time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from dra_driver.cdi.builders import device_env_name
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DriverProcess
from tests.harness.examples import device_class_files, wait_for_slices
from tests.harness.node import Node, Nodes, NodeSpec, node_cluster, wait_until
from tests.harness.objects import (
    apply_documents,
    create_namespace,
    load_yaml_documents,
    sync_client,
    sync_request,
)
from tests.node import pods

JSON = dict[str, Any]
NODE = NodeSpec("mig-a", "hgx-h200-mig", ("--dynamic-mig",))
NS = "dynamic-mig"
EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "mig" / "01-slice-3g-71gb.yaml"
STATIC = (1, 4)  # (gpu, start) of the profile's static 3g.71gb


@dataclass
class Env:
    cp: ControlPlane
    api: client.ApiClient
    nodes: Nodes

    @property
    def node(self) -> Node:
        return self.nodes[NODE.name]

    @property
    def driver(self) -> DriverProcess:
        assert self.node.driver is not None
        return self.node.driver


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if os.geteuid() != 0:
        pytest.fail("the node tier runs real kubelets and containerd: it needs root")
    keep = os.environ.get("DRA_NODE_KEEP") == "1"
    with node_cluster((NODE,), tmp_path_factory.mktemp("dynamic-mig"), keep_files=keep) as (cp, nodes):
        api = sync_client(str(cp.kubeconfig))
        wait_for_slices(api, [n.driver for n in nodes.nodes.values() if n.driver])
        for path in device_class_files():
            applied = apply_documents(api, path, "default")
            assert not applied.problems, f"{path.name}: {applied.problems}"
        create_namespace(api, NS)
        yield Env(cp, api, nodes)


# -- what the node holds ------------------------------------------------------------------------


def instances(env: Env) -> list[JSON]:
    """The MIG instances of the node's GPUs, the static one left out."""
    rows: list[JSON] = json.loads((env.driver.state_dir / "simulated-mig.json").read_text())
    return [r for r in rows if (r["gpu"], r["placement"]) != STATIC]


def checkpoint_entry(env: Env, uid: str) -> JSON | None:
    doc = json.loads((env.driver.state_dir / "checkpoint.json").read_text())
    return next((c for c in doc["payload"]["claims"] if c["uid"] == uid), None)


def start_pod(env: Env, name: str) -> tuple[JSON, str]:
    """The shipped 3g.71gb claim (renamed) and a pod on the node that lists its /dev; returns
    the pod object (not waited for) and the claim's name."""
    (claim,) = load_yaml_documents(EXAMPLE)
    claim["metadata"]["name"] = f"{name}-mig"
    pod = pods.gpu_pod(name, claims={"mig": claim["metadata"]["name"]},
                       command="ls -l /dev/nvidia* /dev/nvidia-caps; env; sleep 3600")
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": NODE.name}
    pods.create(env.api, NS, claim, pod)
    return pod, claim["metadata"]["name"]


def claim_of(env: Env, name: str) -> JSON:
    return sync_request(env.api, "GET", f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{name}")


def check_container_has_its_slice(env: Env, running: JSON, claim: JSON) -> JSON:
    """The container's caps nodes and MIG UUID are those of the claim's CDI spec and of the
    instance NVML holds; returns that instance."""
    uid = claim["metadata"]["uid"]
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    device = result["device"]
    assert device.startswith("gpu-0-mig-3g-71gb-"), f"a 3g.71gb placement of the empty MIG GPU: {device}"
    (spec_path,) = pods.cdi_specs_of(env.node, uid)
    spec = json.loads(spec_path.read_text())
    edits = [d["containerEdits"] for d in spec["devices"]] + [spec.get("containerEdits", {})]
    caps = {n["path"]: (n["major"], n["minor"]) for e in edits for n in e.get("deviceNodes", [])
            if n["path"].startswith("/dev/nvidia-caps/")}
    env_vars = dict(v.split("=", 1) for e in edits for v in e.get("env", []))
    mig_uuid = env_vars[device_env_name(device)]
    (made,) = [r for r in instances(env) if r["uuid"] == mig_uuid]
    assert (made["gpu"], made["placement"]) == (0, int(device.rsplit("-", 1)[1]))
    assert len(caps) == 2, f"the GPU instance's and the compute instance's access caps: {caps}"

    container = pods.container_id(running, "main")
    root = Path(f"/proc/{pods.host_pid(env.node, container)}/root")
    seen = {}
    for entry in (root / "dev" / "nvidia-caps").iterdir():
        st = entry.lstat()
        seen[f"/dev/nvidia-caps/{entry.name}"] = (os.major(st.st_rdev), os.minor(st.st_rdev))
    assert seen == caps, "the container has exactly the caps nodes of its spec"
    assert {d.path for d in pods.live_devices(env.node, container)} >= {"/dev/nvidia0", "/dev/nvidiactl"}
    live_env = pods.live_environment(env.node, container)
    assert live_env[device_env_name(device)] == mig_uuid and mig_uuid.startswith("MIG-")
    return made


def delete_and_wait_destroyed(env: Env, pod: str, uid: str) -> None:
    pods.delete_pod(env.api, NS, pod)
    pods.wait_gone(env.api, NS, pod)
    wait_until("the MIG instance to be destroyed and the claim unprepared",
               lambda: instances(env) == [] and checkpoint_entry(env, uid) is None, 30,
               lambda: env.driver.log_tail())
    assert pods.cdi_specs_of(env.node, uid) == []


# -- tests --------------------------------------------------------------------------------------


def test_a_pod_gets_its_dynamic_mig_slice_and_it_goes_with_the_pod(env: Env) -> None:
    assert instances(env) == []
    pod, name = start_pod(env, "slice")
    running = pods.wait_running(env.api, NS, "slice")
    claim = claim_of(env, name)
    made = check_container_has_its_slice(env, running, claim)
    entry = checkpoint_entry(env, claim["metadata"]["uid"])
    assert entry is not None and entry["phase"] == "completed"
    (record,) = entry["mig"]
    assert (record["gpuInstanceId"], record["uuid"]) == (made["gpu_instance_id"], made["uuid"])

    def status_data() -> JSON:
        devices = claim_of(env, name).get("status", {}).get("devices") or [{}]
        data: JSON = devices[0].get("data") or {}
        return data

    wait_until("the claim's status.devices", lambda: bool(status_data()), 30)
    data = status_data()
    assert data["uuid"] == made["uuid"], "the claim's status names the MIG instance, not its parent GPU"
    assert data["mig"]["gpuInstanceID"] == made["gpu_instance_id"] and data["mig"]["profile"] == "3g.71gb"
    delete_and_wait_destroyed(env, pod["metadata"]["name"], claim["metadata"]["uid"])


def test_kill_between_create_and_checkpoint_leaves_no_orphan_and_no_lost_claim(env: Env) -> None:
    assert instances(env) == []
    driver = env.driver
    before = env.node.registrations()
    driver.stop()
    driver.env["DRA_DRIVER_FAULT"] = "prepare-after-mig-create"
    try:
        driver.start(wait=True)
        env.node.wait_registered(after=before)
        pod, name = start_pod(env, "killed")
        code = driver.wait_exit(timeout=60)  # the kubelet's first NodePrepareResources kills it
    finally:
        driver.env.pop("DRA_DRIVER_FAULT", None)
    assert code == 137
    claim = claim_of(env, name)
    uid = claim["metadata"]["uid"]
    (orphan,) = instances(env)  # made by NVML, outliving the plugin
    entry = checkpoint_entry(env, uid)
    assert entry is not None and entry["phase"] == "started", "only the intent was recorded"
    assert [set(m) for m in entry["mig"]] == [{"device", "parentUUID", "profileId", "start"}]

    before = env.node.registrations()
    driver.start(wait=True)  # as the kubelet restarts the plugin's container
    env.node.wait_registered(after=before)
    log = driver.log_path.read_text(errors="replace")
    destroyed = [json.loads(line) for line in log.splitlines() if '"MIG instance destroyed"' in line]
    assert any(d.get("claim_uid") == uid for d in destroyed), "recovery destroyed the interrupted instance"

    running = pods.wait_running(env.api, NS, "killed", timeout=120)  # the kubelet's retry prepares it
    made = check_container_has_its_slice(env, running, claim_of(env, name))
    assert len(instances(env)) == 1, f"no orphan next to the claim's instance: {instances(env)}"
    assert (made["gpu"], made["placement"]) == (orphan["gpu"], orphan["placement"])
    entry = checkpoint_entry(env, uid)
    assert entry is not None and entry["phase"] == "completed"
    delete_and_wait_destroyed(env, pod["metadata"]["name"], uid)
