"""ComputeDomains on real nodes: each a kubelet + containerd + runc with `dra-driver
kubelet-plugin --compute-domains` on a simulated GB200 tray (two nodes in one NVLink clique,
one in another) and the stand-in IMEX tools (tests/harness/fake_imex.py) in its driver root;
the CRD, the channel class and `dra-driver compute-domain-controller` as the chart ships them.

A two-node job's pods run with exactly their IMEX channel, made by runc from the CDI spec the
plugin wrote, and no GPU; neither pod's spec is written before the slow daemon of the other
node is ready; a pod of the domain on the other clique is held, its events saying why; and
deleting the pods and the domain leaves no daemon, spec, claim or template. NVIDIA's v0.5.0
channel-injection examples (fetched from the Go module proxy) run after the documented sed, their
image swapped for the node tier's busybox (there is no registry here).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.harness.compute_domains import (
    clique_profile,
    compute_domain_controller,
    domain,
    domains_path,
    exists,
)
from tests.harness.driver import DRIVER
from tests.harness.examples import wait_for_slices
from tests.harness.fake_imex import daemon_state, install_fake_imex, set_imex_mode, stop_stand_ins
from tests.harness.node import Nodes, NodeSpec, node_cluster
from tests.harness.nvidia_reference import nvidia_source
from tests.harness.objects import create_namespace, pod_events, sync_client, sync_request, wait_for
from tests.node import pods

NS = "compute-domains"
SLOW = 3.0  # seconds cd-a2's daemon takes to be ready
ROOT = Path(f"/tmp/cdn-{os.getpid()}")


def _args(node: str) -> tuple[str, ...]:
    return ("--compute-domains", "--driver-root", str(ROOT / node / "driver"),
            "--imex-root", str(ROOT / node / "imex"))


@dataclass
class Env:
    api: client.ApiClient
    nodes: Nodes


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if os.geteuid() != 0:
        pytest.fail("the node tier runs real kubelets and containerd: it needs root")
    for node in ("cd-a1", "cd-a2", "cd-b1"):
        install_fake_imex(ROOT / node / "driver")
    profile_b = clique_profile(ROOT / "gb200-clique-b.yaml", 7)
    specs = (NodeSpec("cd-a1", "gb200-nvl-node", _args("cd-a1")),
             NodeSpec("cd-a2", "gb200-nvl-node", _args("cd-a2")),
             NodeSpec("cd-b1", str(profile_b), _args("cd-b1")))
    keep = os.environ.get("DRA_NODE_KEEP") == "1"
    with node_cluster(specs, tmp_path_factory.mktemp("compute-domains"), keep_files=keep) as (cp, nodes):
        api = sync_client(str(cp.kubeconfig))
        wait_for_slices(api, [n.driver for n in nodes.nodes.values() if n.driver])
        with compute_domain_controller(cp, api):
            create_namespace(api, NS)
            try:
                yield Env(api, nodes)
            finally:
                stop_stand_ins(ROOT)


def workload(name: str, node: str, template: str) -> dict[str, Any]:
    pod = pods.gpu_pod(name, templates={"channel": template},
                       command="ls -l /dev/nvidia-caps-imex-channels/* /dev/nvidia*; sleep 3600")
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    return pod


def test_a_jobs_pods_run_with_their_channel_once_every_daemon_is_ready(env: Env) -> None:
    api = env.api
    set_imex_mode(ROOT / "cd-a2" / "driver" / "usr" / "bin", ready_after=SLOW)
    made = sync_request(api, "POST", domains_path(DRIVER, NS), domain("job", "job-channel", numNodes=2))
    uid = made["metadata"]["uid"]
    wait_for("the domain's template", lambda: exists(
        api, f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates/job-channel"))
    pods.create(api, NS, workload("w-a1", "cd-a1", "job-channel"), workload("w-a2", "cd-a2", "job-channel"))
    running = {n: pods.wait_running(api, NS, f"w-{n[3:]}", timeout=120) for n in ("cd-a1", "cd-a2")}

    ready_at = float(daemon_state(ROOT / "cd-a2" / "imex", uid)["ready_at"])  # type: ignore[index, arg-type]
    for node, pod in running.items():
        devices = pods.logged_devices(env.nodes[node], pod, "main")
        channel = ("/dev/nvidia-caps-imex-channels/channel0", 234, 0)
        assert [(d.path, d.major, d.minor) for d in devices] == [channel], node
        (spec,) = pods.cdi_specs_of(env.nodes[node], next(iter(pods.claim_uids(api, pod))))
        # the spec that let the container start was written only once the slow daemon was ready
        assert spec.stat().st_mtime >= ready_at - 0.05, node
    status = sync_request(api, "GET", f"{domains_path(DRIVER, NS)}/job")["status"]
    assert status["status"] == "Ready"
    addresses = {n["name"]: n["ipAddress"] for n in status["nodes"]}
    assert sorted(addresses) == ["cd-a1", "cd-a2"]
    assert addresses["cd-a1"] == env.nodes["cd-a1"].ip  # the Node's InternalIP, as the kubelet wrote it

    # a pod of the domain on the other clique is held, saying why
    pods.create(api, NS, workload("w-b1", "cd-b1", "job-channel"))
    def refused() -> str | None:
        messages = [str(e.get("message")) for e in pod_events(api, NS, "w-b1")]
        return next((m for m in messages if "cannot span two cliques" in m), None)

    refusal = wait_for("the refusal in the pod's events", refused, timeout=60)
    assert "1f0708a8-1f80-4440-970d-338fe7fee8e1.7" in refusal

    for name in ("w-a1", "w-a2", "w-b1"):
        pods.delete_pod(api, NS, name)
    for name in ("w-a1", "w-a2", "w-b1"):
        pods.wait_gone(api, NS, name, timeout=90)
    sync_request(api, "DELETE", f"{domains_path(DRIVER, NS)}/job")
    wait_for("the template garbage-collected", lambda: not exists(
        api, f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates/job-channel"))
    wait_for("the claims gone", lambda: not sync_request(
        api, "GET", f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims")["items"])
    for node in ("cd-a1", "cd-a2", "cd-b1"):
        assert not (ROOT / node / "imex" / uid).exists(), f"{node}: a daemon directory left"
        assert not [p for p in env.nodes[node].cdi_dir.iterdir() if "channel" in p.read_text()], node


SED = re.compile(r"^sed -e '(?P<expression>[^']+)'", re.M)


@pytest.mark.parametrize(("spec", "channels"),
                         [("channel-injection.yaml", 1), ("channel-injection-all.yaml", 2048)])
def test_nvidias_channel_injection_examples_run_after_the_documented_sed(
    env: Env, spec: str, channels: int
) -> None:
    api = env.api
    docs = (Path(__file__).resolve().parents[2] / "docs" / "compute-domains.md").read_text()
    match = SED.search(docs)
    assert match, "docs/compute-domains.md has no sed line"
    source = nvidia_source() / "demo" / "specs" / "imex" / spec
    changed = subprocess.run(["sed", "-e", match.group("expression"), str(source)],
                             capture_output=True, text=True, check=True).stdout
    domain_doc, pod = (d for d in yaml.safe_load_all(changed) if d)
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "ubuntu:22.04" and container["command"] == ["bash", "-c"]
    container |= {"image": "busybox:1.37", "command": ["sh", "-c"]}
    made = sync_request(api, "POST", domains_path(DRIVER, NS), domain_doc)
    template = domain_doc["spec"]["channel"]["resourceClaimTemplate"]["name"]
    wait_for("the example's template", lambda: exists(
        api, f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates/{template}"))
    pods.create(api, NS, pod)
    running = pods.wait_running(api, NS, pod["metadata"]["name"], timeout=120)
    node = env.nodes[running["spec"]["nodeName"]]
    pid = pods.host_pid(node, pods.container_id(running, "ctr"))
    channel_dir = Path(f"/proc/{pid}/root/dev/nvidia-caps-imex-channels")
    seen = sorted(p.name for p in channel_dir.iterdir())
    assert seen == sorted(f"channel{n}" for n in range(channels))
    pods.delete_pod(api, NS, pod["metadata"]["name"])
    pods.wait_gone(api, NS, pod["metadata"]["name"], timeout=90)
    sync_request(api, "DELETE", f"{domains_path(DRIVER, NS)}/{domain_doc['metadata']['name']}")
    wait_for("the daemon stopped", lambda: not (ROOT / node.name / "imex" / made["metadata"]["uid"]).exists())
