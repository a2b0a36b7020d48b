"""ComputeDomains across simulated nodes: the real API server, scheduler, garbage collector and
`dra-driver compute-domain-controller`, one `dra-driver kubelet-plugin --compute-domains` per node
(GB200 trays: five nodes in one NVLink clique, one in another) with the stand-in IMEX tools
(tests/harness/fake_imex.py) as their daemons, and the kubelet's side of the gRPC.

What is checked: a job's channel Prepare answers only once every daemon of its domain is ready
(one daemon made slow); each pod's CDI spec holds exactly its channel; two domains on one clique
keep apart; a domain never spans two cliques; kill -9 of a plugin or of a daemon while a job
waits leaves nothing stuck; and unprepare plus deletion leave no daemon, entry, spec or template.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from dra_driver.imex.channels import CHANNEL_DEVICE
from tests.harness.cluster import ControlPlane
from tests.harness.compute_domains import (
    channel_published,
    clique_profile,
    compute_domain_controller,
    domain,
    domains_path,
    exists,
    prepare_all,
)
from tests.harness.driver import DRIVER
from tests.harness.fake_imex import daemon_state, install_fake_imex, set_imex_mode, stop_stand_ins
from tests.harness.kubelet import ClaimName, KubeletSide, claim_ref, prepared_cdi_ids
from tests.harness.objects import get_claim, get_pod, sync_request, wait_for
from tests.harness.plugin_node import PluginNode, plugin_node

CLIQUE_A = "1f0708a8-1f80-4440-970d-338fe7fee8e1.32766"
CLIQUE_B = "1f0708a8-1f80-4440-970d-338fe7fee8e1.7"
WAIT = 8.0  # --compute-domain-wait: what one Prepare call holds at most
SLOW = 3.0  # how long the slow node's daemon takes to become ready


@dataclass
class Rack:
    nodes: dict[str, PluginNode]
    roots: dict[str, Path]

    def imex_root(self, node: str) -> Path:
        return self.roots[node] / "imex"

    def bin_dir(self, node: str) -> Path:
        return self.roots[node] / "driver" / "usr" / "bin"


@pytest.fixture(scope="module")
def controller(control_plane: ControlPlane, api: client.ApiClient) -> Iterator[object]:
    with compute_domain_controller(control_plane, api) as proc:
        yield proc


@pytest.fixture(scope="module")
def rack(control_plane: ControlPlane, api: client.ApiClient, controller: object,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rack]:
    base = tmp_path_factory.mktemp("rack")
    profile_b = clique_profile(base / "gb200-clique-b.yaml", 7)
    names = {f"cd-a{i}-{os.getpid()}": "gb200-nvl-node" for i in range(1, 6)}
    names[f"cd-b1-{os.getpid()}"] = str(profile_b)
    roots = {name: Path(f"/tmp/cdr-{i}-{os.getpid()}") for i, name in enumerate(names)}
    nodes: dict[str, PluginNode] = {}
    with contextlib.ExitStack() as stack:
        for i, (name, profile) in enumerate(names.items()):
            root = roots[name]
            install_fake_imex(root / "driver")
            args = ["--compute-domains", "--imex-root", str(root / "imex"), "--node-ip", f"10.9.0.{i + 1}",
                    "--driver-root", str(root / "driver"), "--compute-domain-wait", str(WAIT)]
            nodes[name] = stack.enter_context(plugin_node(
                api, control_plane.kubeconfig, name, profile, root, args,
                published=lambda n=name: channel_published(api, n),
            ))
        try:
            yield Rack(nodes, roots)
        finally:
            for root in roots.values():
                stop_stand_ins(root)


def node_named(rack: Rack, prefix: str) -> str:
    return next(n for n in rack.nodes if n.startswith(prefix))


def workload_pod(name: str, node: str, template: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "automountServiceAccountToken": False,
            "resourceClaims": [{"name": "channel", "resourceClaimTemplateName": template}],
            "containers": [{"name": "main", "image": "busybox:1.37", "command": ["sleep", "1"],
                            "resources": {"claims": [{"name": "channel"}]}}],
        },
    }


def make_domain(api: client.ApiClient, ns: str, name: str, num_nodes: int, **spec: Any) -> dict[str, Any]:
    body = domain(name, f"{name}-channel", numNodes=num_nodes, **spec)
    made = sync_request(api, "POST", domains_path(DRIVER, ns), body)
    wait_for("the domain's template", lambda: exists(api, f"/apis/resource.k8s.io/v1/namespaces/{ns}/"
                                                          f"resourceclaimtemplates/{name}-channel"))
    return made




def allocated_claim(api: client.ApiClient, ns: str, pod: str) -> ClaimName:
    """The pod's channel claim once the scheduler allocated it on the pod's node."""
    def found() -> ClaimName | None:
        p = get_pod(api, ns, pod)
        statuses = (p.get("status") or {}).get("resourceClaimStatuses") or []
        if not statuses or not statuses[0].get("resourceClaimName"):
            return None
        claim = get_claim(api, ns, statuses[0]["resourceClaimName"])
        return claim_ref(claim) if (claim.get("status") or {}).get("allocation") else None

    return wait_for(f"the channel claim of {pod} allocated", found, timeout=60)


def start_pods(api: client.ApiClient, ns: str, template: str, nodes: list[str]) -> dict[str, ClaimName]:
    """A pod of the domain's template on each node; its claim, allocated, by node."""
    for node in nodes:
        pod = workload_pod(f"{template}-{node}", node, template)
        sync_request(api, "POST", f"/api/v1/namespaces/{ns}/pods", pod)
    return {node: allocated_claim(api, ns, f"{template}-{node}") for node in nodes}


def get_domain(api: client.ApiClient, ns: str, name: str) -> dict[str, Any]:
    return sync_request(api, "GET", f"{domains_path(DRIVER, ns)}/{name}")


def spec_nodes(plugin: PluginNode, claim: ClaimName) -> list[dict[str, Any]]:
    spec = json.loads(next(plugin.plugin.cdi_dir.glob(f"*{claim.uid}*")).read_text())
    (device,) = spec["devices"]
    assert not spec.get("containerEdits"), "a channel claim gets no GPU, library or control node"
    return list(device["containerEdits"]["deviceNodes"])


def test_a_job_starts_only_once_every_daemon_of_its_domain_is_ready(
    api: client.ApiClient, namespace: str, rack: Rack
) -> None:
    job = [node_named(rack, f"cd-a{i}") for i in range(1, 5)]
    a1, a4 = job[0], job[3]
    set_imex_mode(rack.bin_dir(a4), ready_after=SLOW)
    made = make_domain(api, namespace, "job", 4)
    uid = made["metadata"]["uid"]
    claims = start_pods(api, namespace, "job-channel", job)

    # alone, a node's Prepare answers what the domain waits for: the others have not joined
    started = time.monotonic()
    alone = rack.nodes[a1].side.prepare(claims[a1])
    assert time.monotonic() - started >= WAIT - 0.5
    _, error = prepared_cdi_ids(alone, claims[a1].uid)
    assert "waiting for ComputeDomain" in error and "1 of spec.numNodes 4 nodes have joined" in error, error
    assert daemon_state(rack.imex_root(a1), uid) is not None, "the daemon starts at the first Prepare"

    def prepare(node: str) -> tuple[str, float]:
        answer = rack.nodes[node].side.prepare(claims[node])
        ids, error = prepared_cdi_ids(answer, claims[node].uid)
        return (error or ids[0]), time.monotonic()

    started = time.monotonic()
    with ThreadPoolExecutor(len(job)) as pool:
        answers = dict(zip(job, pool.map(prepare, job), strict=True))
    a4_ready = float(daemon_state(rack.imex_root(a4), uid)["ready_at"])  # type: ignore[index, arg-type]
    for node, (answer, at) in answers.items():
        assert answer.endswith(f"{claims[node].uid}-{CHANNEL_DEVICE}"), f"{node}: {answer}"
        # no node's Prepare answered before the slow daemon was ready
        assert time.time() - (time.monotonic() - at) >= a4_ready - 0.05, node
    assert time.monotonic() - started >= SLOW - 1.0

    for node in job:
        (channel,) = spec_nodes(rack.nodes[node], claims[node])
        assert channel == {"path": "/dev/nvidia-caps-imex-channels/channel0", "type": "c", "major": 234,
                           "minor": 0, "fileMode": 438}
        state = daemon_state(rack.imex_root(node), uid)
        peers = ["10.9.0.1", "10.9.0.2", "10.9.0.3", "10.9.0.4"]
        assert state is not None and sorted(state["peers"]) == peers  # type: ignore[call-overload]
    status = wait_for("the domain Ready", lambda: (d := get_domain(api, namespace, "job"))
                      .get("status", {}).get("status") == "Ready" and d)
    assert sorted((n["name"], n["cliqueID"], n["status"]) for n in status["status"]["nodes"]) == sorted(
        (n, CLIQUE_A, "Ready") for n in job)
    assert sorted(n["index"] for n in status["status"]["nodes"]) == [0, 1, 2, 3]

    # a second domain on the same clique, beside it: its own daemon on its own node
    a5 = node_named(rack, "cd-a5")
    second = make_domain(api, namespace, "solo", 1)
    (solo,) = start_pods(api, namespace, "solo-channel", [a5]).values()
    ids, error = prepared_cdi_ids(rack.nodes[a5].side.prepare(solo), solo.uid)
    assert ids and not error, error
    assert daemon_state(rack.imex_root(a5), second["metadata"]["uid"]) is not None
    assert daemon_state(rack.imex_root(a5), uid) is None
    assert [n["name"] for n in get_domain(api, namespace, "solo")["status"]["nodes"]] == [a5]
    assert a5 not in {n["name"] for n in get_domain(api, namespace, "job")["status"]["nodes"]}

    # unprepared: each node leaves, its daemon stops; deleted: nothing of the domain is left
    for node in job:
        assert not rack.nodes[node].side.unprepare(claims[node]).claims[claims[node].uid].error
        assert not (rack.imex_root(node) / uid).exists()
        assert not list(rack.nodes[node].plugin.cdi_dir.glob(f"*{claims[node].uid}*"))
    wait_for("every node left", lambda: not get_domain(api, namespace, "job").get("status", {}).get("nodes"))
    assert not rack.nodes[a5].side.unprepare(solo).claims[solo.uid].error
    sync_request(api, "DELETE", f"/api/v1/namespaces/{namespace}/pods")
    for name in ("job", "solo"):
        sync_request(api, "DELETE", f"{domains_path(DRIVER, namespace)}/{name}")
        wait_for("the template garbage-collected", lambda n=name: not exists(
            api, f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates/{n}-channel"))
    for root in rack.roots.values():
        assert not list((root / "imex").glob("*-*")), "a daemon directory left behind"


def test_a_domain_never_spans_two_cliques(api: client.ApiClient, namespace: str, rack: Rack) -> None:
    a3, b1 = node_named(rack, "cd-a3"), node_named(rack, "cd-b1")
    made = make_domain(api, namespace, "span", 1)
    claims = start_pods(api, namespace, "span-channel", [b1])
    ids, error = prepared_cdi_ids(rack.nodes[b1].side.prepare(claims[b1]), claims[b1].uid)
    assert ids and not error, error
    (other,) = start_pods(api, namespace, "span-channel", [a3]).values()
    _, error = prepared_cdi_ids(rack.nodes[a3].side.prepare(other), other.uid)
    assert "cannot span two cliques" in error and CLIQUE_A in error and CLIQUE_B in error, error
    assert not (rack.imex_root(a3) / made["metadata"]["uid"]).exists(), "no daemon for a refused node"
    for node, claim in ((b1, claims[b1]), (a3, other)):
        assert not rack.nodes[node].side.unprepare(claim).claims[claim.uid].error


def test_kill_9_of_a_plugin_or_a_daemon_while_a_job_waits_leaves_nothing_stuck(
    api: client.ApiClient, namespace: str, rack: Rack
) -> None:
    a1, a2 = node_named(rack, "cd-a1"), node_named(rack, "cd-a2")
    set_imex_mode(rack.bin_dir(a1), ready_after=0)
    made = make_domain(api, namespace, "crash", 2)
    uid = made["metadata"]["uid"]
    claims = start_pods(api, namespace, "crash-channel", [a1, a2])
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(rack.nodes[a1].side.prepare, claims[a1])
        daemon = wait_for("a1's daemon", lambda: daemon_state(rack.imex_root(a1), uid), timeout=WAIT)
        rack.nodes[a1].plugin.stop(sig=signal.SIGKILL)
        with pytest.raises(Exception):  # noqa: B017 - the call dies with the plugin
            waiting.result(timeout=WAIT + 5)
    os.kill(int(daemon["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    rack.nodes[a1].plugin.start()
    rack.nodes[a1].side.close()
    plugin = rack.nodes[a1].plugin
    rack.nodes[a1] = PluginNode(a1, plugin, KubeletSide(plugin.registration_socket()))
    answers = prepare_all({n: p.side for n, p in rack.nodes.items()}, claims)
    assert all(ids and not error for ids, error in answers), answers
    restarted = daemon_state(rack.imex_root(a1), uid)
    assert restarted is not None and restarted["pid"] != daemon["pid"]
    for node in (a1, a2):
        assert not rack.nodes[node].side.unprepare(claims[node]).claims[claims[node].uid].error
        assert not (rack.imex_root(node) / uid).exists()


def set_node_ready(api: client.ApiClient, node: str, ready: bool) -> None:
    """What the node-lifecycle controller writes when a kubelet stops reporting (there is none here)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    condition = {"type": "Ready", "status": "True" if ready else "Unknown", "reason": "Test",
                 "lastHeartbeatTime": now, "lastTransitionTime": now}
    sync_request(api, "PATCH", f"/api/v1/nodes/{node}/status", {"status": {"conditions": [condition]}},
                 content_type="application/strategic-merge-patch+json")


def test_a_node_that_dies_leaves_its_domain_not_ready_naming_it_and_a_replacement_joins(
    api: client.ApiClient, namespace: str, rack: Rack
) -> None:
    a1, a2, a3 = (node_named(rack, p) for p in ("cd-a1", "cd-a2", "cd-a3"))
    made = make_domain(api, namespace, "heal", 2)
    uid = made["metadata"]["uid"]
    claims = start_pods(api, namespace, "heal-channel", [a1, a2])
    started = prepare_all({n: p.side for n, p in rack.nodes.items()}, claims)
    assert all(ids and not error for ids, error in started), started

    rack.nodes[a2].plugin.stop(sig=signal.SIGKILL)  # the node dies: its plugin and its kubelet
    set_node_ready(api, a2, False)
    try:
        def a2_not_ready() -> dict[str, Any] | None:
            d = get_domain(api, namespace, "heal")
            entries = {n["name"]: n["status"] for n in d["status"].get("nodes", [])}
            return d if d["status"].get("status") == "NotReady" and entries.get(a2) == "NotReady" else None

        wait_for("the domain NotReady with a2 NotReady", a2_not_ready, timeout=60)
        events = sync_request(api, "GET", f"/api/v1/namespaces/{namespace}/events",
                              query={"fieldSelector": "reason=NodeDown"})["items"]
        assert any(a2 in e["message"] for e in events), events

        # its pod is force-deleted (the node never unprepared): its entry goes, a replacement joins
        sync_request(api, "DELETE", f"/api/v1/namespaces/{namespace}/pods/heal-channel-{a2}",
                     query={"gracePeriodSeconds": "0"})
        wait_for("a2's entry removed", lambda: a2 not in {
            n["name"] for n in get_domain(api, namespace, "heal")["status"].get("nodes", [])}, timeout=60)
        (replacement,) = start_pods(api, namespace, "heal-channel", [a3]).values()
        ids, error = prepared_cdi_ids(rack.nodes[a3].side.prepare(replacement), replacement.uid)
        assert ids and not error, error
        healed = wait_for("the domain Ready again", lambda: (d := get_domain(api, namespace, "heal"))
                          ["status"].get("status") == "Ready" and d)
        assert sorted(n["name"] for n in healed["status"]["nodes"]) == sorted([a1, a3])
    finally:  # a2 comes back: its kubelet unprepares what it held
        set_node_ready(api, a2, True)
        rack.nodes[a2].plugin.start()
        rack.nodes[a2].side.close()
        plugin = rack.nodes[a2].plugin
        rack.nodes[a2] = PluginNode(a2, plugin, KubeletSide(plugin.registration_socket()))
    assert not rack.nodes[a2].side.unprepare(claims[a2]).claims[claims[a2].uid].error
    assert not (rack.imex_root(a2) / uid).exists()
    for node, claim in ((a1, claims[a1]), (a3, replacement)):
        assert not rack.nodes[node].side.unprepare(claim).claims[claim.uid].error
