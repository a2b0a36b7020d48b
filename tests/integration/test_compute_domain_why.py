"""`kubectl gpu why POD` and `kubectl gpu NODE` on ComputeDomain pods, run as a user runs them
(the real kubectl finding the plugin on PATH) against the real API server, scheduler, garbage
collector and `dra-driver compute-domain-controller`, with simulated GB200 trays (two nodes in
one NVLink clique, one in another), each a `dra-driver kubelet-plugin --compute-domains` with
the stand-in IMEX tools, and the kubelet's side of the gRPC.

What is checked: a pod held by its channel Prepare is explained by what its domain waits for
(who joined, who is not ready), and the node view shows the channel's claim and the domain; a
pod on a node of another clique is told why it can never join; a pod whose domain was deleted
is told so; a pod whose channel no node publishes is told why.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.harness.cluster import ControlPlane
from tests.harness.compute_domains import (
    channel_published,
    clique_profile,
    compute_domain_controller,
    domain,
    domains_path,
    exists,
)
from tests.harness.driver import DRIVER
from tests.harness.fake_imex import install_fake_imex
from tests.harness.kubelet import ClaimName, claim_ref, prepared_cdi_ids
from tests.harness.objects import get_claim, get_pod, sync_request, wait_for
from tests.harness.plugin_node import PluginNode, plugin_node

CLIQUE_A = "1f0708a8-1f80-4440-970d-338fe7fee8e1.32766"
CLIQUE_B = "1f0708a8-1f80-4440-970d-338fe7fee8e1.7"
WAIT = 1.0  # --compute-domain-wait: what one Prepare call holds at most
KUBECTL_GPU = Path(sys.executable).parent / "kubectl-gpu"


@pytest.fixture(scope="module")
def controller(control_plane: ControlPlane, api: client.ApiClient) -> Iterator[object]:
    with compute_domain_controller(control_plane, api) as proc:
        yield proc


@pytest.fixture(scope="module")
def rack(control_plane: ControlPlane, api: client.ApiClient, controller: object,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, PluginNode]]:
    profile_b = clique_profile(tmp_path_factory.mktemp("why-rack") / "gb200-clique-b.yaml", 7)
    names = {f"why-a1-{os.getpid()}": "gb200-nvl-node", f"why-a2-{os.getpid()}": "gb200-nvl-node",
             f"why-b1-{os.getpid()}": str(profile_b)}
    nodes: dict[str, PluginNode] = {}
    with contextlib.ExitStack() as stack:
        for i, (name, profile) in enumerate(names.items()):
            root = Path(f"/tmp/cdw-{i}-{os.getpid()}")
            stack.callback(shutil.rmtree, root, ignore_errors=True)
            install_fake_imex(root / "driver")
            args = ["--compute-domains", "--imex-root", str(root / "imex"), "--node-ip", f"10.8.0.{i + 1}",
                    "--driver-root", str(root / "driver"), "--compute-domain-wait", str(WAIT)]
            nodes[name] = stack.enter_context(plugin_node(
                api, control_plane.kubeconfig, name, profile, root, args,
                published=functools.partial(channel_published, api, name)))
        yield nodes


def kubectl_gpu(control_plane: ControlPlane, *args: str) -> tuple[str, float]:
    """The real kubectl running the plugin from PATH; its output and the CPU seconds it took."""
    env = {**os.environ, "PATH": f"{KUBECTL_GPU.parent}:{os.environ.get('PATH', '')}",
           "KUBECONFIG": str(control_plane.kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([str(control_plane.bin_dir / "kubectl"), "gpu", *args], capture_output=True,
                          text=True, env=env, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert done.returncode == 0, done.stderr
    return done.stdout, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def workload_pod(name: str, node: str | None, template: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            **({"nodeSelector": {"kubernetes.io/hostname": node}} if node else {}),
            "automountServiceAccountToken": False,
            "resourceClaims": [{"name": "channel", "resourceClaimTemplateName": template}],
            "containers": [{"name": "main", "image": "busybox:1.37", "command": ["sleep", "1"],
                            "resources": {"claims": [{"name": "channel"}]}}],
        },
    }


def make_domain(api: client.ApiClient, ns: str, name: str, num_nodes: int) -> dict[str, Any]:
    body = domain(name, f"{name}-channel", numNodes=num_nodes)
    made = sync_request(api, "POST", domains_path(DRIVER, ns), body)
    wait_for("the domain's template", lambda: exists(api, f"/apis/resource.k8s.io/v1/namespaces/{ns}/"
                                                          f"resourceclaimtemplates/{name}-channel"))
    return made


def start_pod(api: client.ApiClient, ns: str, name: str, node: str, template: str) -> ClaimName:
    """The pod, bound to `node` by the scheduler with its channel claim allocated there."""
    sync_request(api, "POST", f"/api/v1/namespaces/{ns}/pods", workload_pod(name, node, template))

    def found() -> ClaimName | None:
        pod = get_pod(api, ns, name)
        statuses = (pod.get("status") or {}).get("resourceClaimStatuses") or []
        if not pod["spec"].get("nodeName") or not statuses or not statuses[0].get("resourceClaimName"):
            return None
        claim = get_claim(api, ns, statuses[0]["resourceClaimName"])
        return claim_ref(claim) if (claim.get("status") or {}).get("allocation") else None

    return wait_for(f"{name} bound with its channel allocated", found, timeout=60)


def test_no_node_publishing_a_channel_is_said(
    control_plane: ControlPlane, api: client.ApiClient, namespace: str, controller: object
) -> None:
    # before the rack: no node of this cluster publishes a channel
    make_domain(api, namespace, "lonely", 1)
    pod = workload_pod("w", None, "lonely-channel")
    sync_request(api, "POST", f"/api/v1/namespaces/{namespace}/pods", pod)
    out, _ = kubectl_gpu(control_plane, "why", "-n", namespace, "w")
    assert out.startswith(f"pod {namespace}/w waits for ComputeDomain {namespace}/lonely: no node publishes "
                          "an IMEX channel"), out
    assert f"ComputeDomain {namespace}/lonely (claim channel): NotReady, numNodes 1, 0 joined" in out, out


def test_why_explains_a_pod_that_waits_for_its_domain_the_other_clique_and_the_deleted_domain(
    control_plane: ControlPlane, api: client.ApiClient, namespace: str, rack: dict[str, PluginNode]
) -> None:
    a1, a2, b1 = (next(n for n in rack if n.startswith(p)) for p in ("why-a1", "why-a2", "why-b1"))
    make_domain(api, namespace, "job", 2)
    claim = start_pod(api, namespace, "w0", a1, "job-channel")
    _, error = prepared_cdi_ids(rack[a1].side.prepare(claim), claim.uid)
    assert "1 of spec.numNodes 2 nodes have joined" in error, error

    out, cpu = kubectl_gpu(control_plane, "why", "-n", namespace, "w0")
    print(f"\nkubectl gpu why on a waiting pod: {cpu:.3f} s CPU")
    assert out.startswith(f"pod {namespace}/w0 is bound to node {a1} and waits for ComputeDomain "
                          f"{namespace}/job: 1 of spec.numNodes 2 nodes have joined"), out
    assert f"ComputeDomain {namespace}/job (claim channel): NotReady, numNodes 2, 1 joined" in out, out
    assert f"  joined: {a1} (Ready)" in out and f"  the pod's node {a1}: Ready" in out, out

    view, cpu = kubectl_gpu(control_plane, a1)
    print(f"kubectl gpu NODE with a channel: {cpu:.3f} s CPU")
    assert "IMEX channels (ComputeDomains)" in view and f"{namespace}/{claim.name}" in view, view
    domain_line = next(line for line in view.splitlines() if line.startswith(f"{namespace}/job "))
    assert domain_line.split()[:6] == [f"{namespace}/job", "NotReady", "1", "of", "2", "Ready"], view
    assert domain_line.endswith("1 of spec.numNodes 2 nodes have joined"), view
    free, _ = kubectl_gpu(control_plane, a2)
    assert "IMEX channels" in free and "ComputeDomains of this node" not in free, free

    # a pod of the domain on the other clique: its Prepare is refused, and why says so
    other = start_pod(api, namespace, "w9", b1, "job-channel")
    _, error = prepared_cdi_ids(rack[b1].side.prepare(other), other.uid)
    assert "cannot span two cliques" in error, error
    out, _ = kubectl_gpu(control_plane, "why", "-n", namespace, "w9")
    assert f"waits for ComputeDomain {namespace}/job: its node cannot join the domain: node {b1} is in " \
           f"NVLink clique {CLIQUE_B}" in out and CLIQUE_A in out, out

    # the domain deleted: the pods it left can never start
    uid = sync_request(api, "GET", f"{domains_path(DRIVER, namespace)}/job")["metadata"]["uid"]
    sync_request(api, "DELETE", f"{domains_path(DRIVER, namespace)}/job")
    wait_for("the domain gone", lambda: not exists(api, f"{domains_path(DRIVER, namespace)}/job"))
    out, _ = kubectl_gpu(control_plane, "why", "-n", namespace, "w0")
    assert f"waits for ComputeDomain UID {uid}: its ComputeDomain (UID {uid}) does not exist in namespace " \
           f"{namespace}: it was deleted" in out, out
    view, _ = kubectl_gpu(control_plane, a1)
    assert f"UID {uid} (missing)" in view, view

    for node, c in ((a1, claim), (b1, other)):
        assert not rack[node].side.unprepare(c).claims[c.uid].error
