"""ComputeDomains in `kubectl gpu NODE` and `kubectl gpu why POD`: the node's channel, who holds
it and for which domain; a waiting pod's domain and what it waits for, and the cases where it
can never start (the domain deleted, the node in another clique, no node with a channel); and
nothing about domains, without an error, where the server does not serve them."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from controller import compute_domains as cdc
from controller.slices import SliceFeatures, desired_slices
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver import kube
from dra_driver.commands import status
from dra_driver.commands.domains import domain_ref, domain_reports, domains_path, with_domains
from dra_driver.commands.status import node_view, render
from dra_driver.explain.why import PodClaim, explain_pod
from dra_driver.gpu import discover
from dra_driver.jsontypes import JSON

CLIQUE_A = "1f0708a8-1f80-4440-970d-338fe7fee8e1.32766"
CLIQUE_B = "1f0708a8-1f80-4440-970d-338fe7fee8e1.7"
NS = "ml"


def node_slices(node: str, clique: str = CLIQUE_A, channel: bool = True) -> list[JSON]:
    specs = desired_slices(discover("gb200-nvl-node"), node, DRIVER, SliceFeatures(compute_domains=channel))
    out: list[JSON] = [{"metadata": {"name": f"{node}-{i}"}, "spec": s} for i, s in enumerate(specs)]
    for s in out:
        for d in s["spec"].get("devices") or []:
            if "cliqueID" in d.get("attributes", {}) and d["name"] == "channel-0":
                d["attributes"]["cliqueID"] = {"string": clique}
    return out


def compute_domain(name: str, uid: str, num_nodes: int, entries: list[tuple[str, str, str]]) -> JSON:
    """`entries`: (node, clique, status)."""
    return {
        "apiVersion": cdc.api_version(DRIVER), "kind": "ComputeDomain",
        "metadata": {"namespace": NS, "name": name, "uid": uid},
        "spec": {"numNodes": num_nodes, "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}}},
        "status": {"status": "NotReady", "nodes": [
            {"name": n, "ipAddress": f"10.0.0.{i}", "cliqueID": c, "index": i, "status": s}
            for i, (n, c, s) in enumerate(entries)]},
    }


def channel_claim(name: str, domain: JSON, node: str | None, pod: str) -> JSON:
    spec = cdc.workload_template(domain, DRIVER)["spec"]["spec"]
    claim: JSON = {"metadata": {"namespace": NS, "name": name, "uid": f"uid-{name}"}, "spec": spec}
    if node is not None:
        claim["status"] = {
            "allocation": {
                "devices": {"results": [{"request": "channel", "driver": DRIVER, "pool": node,
                                         "device": "channel-0"}],
                            "config": [{**c, "source": "FromClaim"} for c in spec["devices"]["config"]]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
            },
            "reservedFor": [{"resource": "pods", "name": pod, "uid": f"uid-{pod}"}],
        }
    return claim


def workload_pod(name: str, node: str | None, claim: str | None) -> JSON:
    status: JSON = {"phase": "Pending"}
    if claim:
        status["resourceClaimStatuses"] = [{"name": "channel", "resourceClaimName": claim}]
    return {
        "metadata": {"namespace": NS, "name": name, "uid": f"uid-{name}"},
        "spec": {**({"nodeName": node} if node else {}),
                 "resourceClaims": [{"name": "channel", "resourceClaimTemplateName": "job-channel"}]},
        "status": status,
    }


JOB = compute_domain("job", "d-1", 3, [("a1", CLIQUE_A, "Ready"), ("a2", CLIQUE_A, "NotReady")])


# --------------------------------------------------------------------------- kubectl gpu NODE


def test_a_node_shows_its_channel_the_claim_that_holds_it_and_the_domain_with_this_nodes_entry() -> None:
    claim = channel_claim("job-channel-x", JOB, "a1", "worker-0")
    view = node_view("a1", DRIVER, node_slices("a1"), [claim], [], [JOB])
    (channel,) = view.channels
    assert (channel.device, channel.clique, channel.claim, channel.pods, channel.domain) == (
        "channel-0", CLIQUE_A, f"{NS}/job-channel-x", (f"{NS}/worker-0",), f"{NS}/job")
    (row,) = view.domains
    assert (row.domain, row.status, row.num_nodes, row.joined, row.this_node) == (
        f"{NS}/job", "NotReady", 3, 2, "Ready")
    assert row.waiting_for == ("2 of spec.numNodes 3 nodes have joined; the IMEX daemon is not ready on a2")
    text = render(view)
    assert "IMEX channels (ComputeDomains)" in text and f"{NS}/job-channel-x" in text
    assert "ComputeDomains of this node" in text and "2 of 3" in text
    assert len(view.gpus) == 4, "the channel is no GPU"


def test_a_node_in_a_domain_with_its_channel_free_and_a_deleted_domain_are_said() -> None:
    # a2 is listed in the domain but its channel is free; a1's channel is held for a deleted domain
    free = node_view("a2", DRIVER, node_slices("a2"), [], [], [JOB])
    assert free.channels[0].claim is None and "free" in render(free)
    assert free.domains[0].this_node == "NotReady"
    gone = compute_domain("gone", "d-gone", 1, [])
    held = node_view("a1", DRIVER, node_slices("a1"), [channel_claim("c", gone, "a1", "p")], [], [])
    assert held.channels[0].domain == "UID d-gone (missing)" and held.domains == ()


def test_without_the_compute_domain_api_nothing_about_domains_is_shown() -> None:
    claim = channel_claim("job-channel-x", JOB, "a1", "worker-0")
    view = node_view("a1", DRIVER, node_slices("a1"), [claim], [], None)
    assert view.domains == () and view.channels[0].domain is None
    assert "ComputeDomains of this node" not in render(view)
    plain = node_view("n", DRIVER, node_slices("n", channel=False), [], [])
    assert plain.channels == () and "IMEX" not in render(plain)


@pytest.mark.parametrize("answer", [404, 200])
def test_kubectl_gpu_on_a_node_with_a_channel_reads_domains_only_where_served(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], answer: int
) -> None:
    claim = channel_claim("job-channel-x", JOB, "a1", "worker-0")
    asked: list[str] = []

    async def request(api: object, method: str, path: str, **_: Any) -> JSON:
        asked.append(path)
        if path == domains_path(DRIVER):
            if answer == 404:
                raise kube.ApiException(404, "Not Found", "the server could not find the requested resource")
            return {"items": [JOB]}
        known: dict[str, JSON] = {"/api/v1/nodes/a1": {},
                                  "/apis/resource.k8s.io/v1/resourceslices": {"items": node_slices("a1")},
                                  "/apis/resource.k8s.io/v1/resourceclaims": {"items": [claim]}}
        return known.get(path, {"items": []})

    await_client(monkeypatch)
    monkeypatch.setattr(kube, "request", request)
    monkeypatch.setattr(sys, "argv", ["kubectl-gpu", "a1"])
    with pytest.raises(SystemExit) as done:
        status.main()
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert domains_path(DRIVER) in asked and "channel-0" in out
    assert ("ComputeDomains of this node" in out) == (answer == 200), out


def await_client(monkeypatch: pytest.MonkeyPatch) -> None:
    class Api:
        async def close(self) -> None:
            pass

    async def load_client(kubeconfig: str | None = None) -> Api:
        return Api()

    monkeypatch.setattr(kube, "load_client", load_client)


# --------------------------------------------------------------------------- kubectl gpu why POD


def _why(pod: JSON, claim: JSON | None, domains: list[JSON] | None, slices: list[JSON]) -> tuple[Any, Any]:
    template = None if claim else cdc.workload_template(JOB, DRIVER)["spec"]["spec"]
    claims = [PodClaim("channel", claim, template)]
    report = explain_pod(pod, claims, [], slices, {}, [])
    found = domain_reports(pod, claims, domains, slices)
    return with_domains(report, found), found


def test_a_bound_pod_waiting_for_its_domain_says_who_joined_who_is_not_ready_and_what_it_waits_for() -> None:
    claim = channel_claim("job-channel-x", JOB, "a1", "worker-0")
    report, (d,) = _why(workload_pod("worker-0", "a1", "job-channel-x"), claim, [JOB], node_slices("a1"))
    assert (d.domain, d.status, d.num_nodes, d.joined, d.not_ready, d.node, d.node_entry) == (
        f"{NS}/job", "NotReady", 3, ("a1 (Ready)", "a2 (NotReady)"), ("a2",), "a1", "Ready")
    assert report.headline == (f"pod {NS}/worker-0 is bound to node a1 and waits for ComputeDomain {NS}/job: "
                               "2 of spec.numNodes 3 nodes have joined; the IMEX daemon is not ready on a2")


def test_a_node_not_joined_yet_is_said_and_a_ready_domain_holds_nothing() -> None:
    claim = channel_claim("job-channel-x", JOB, "a3", "worker-2")
    _, (d,) = _why(workload_pod("worker-2", "a3", "job-channel-x"), claim, [JOB], node_slices("a3"))
    assert d.node_entry == "not joined" and d.waits_for is not None
    assert d.waits_for.endswith(
        "node a3 has not joined yet (its kubelet plugin joins at the channel's Prepare)")
    ready = compute_domain("job", "d-1", 1, [("a1", CLIQUE_A, "Ready")])
    report, (r,) = _why(workload_pod("worker-0", "a1", "job-channel-x"),
                        channel_claim("job-channel-x", ready, "a1", "worker-0"), [ready], node_slices("a1"))
    assert r.status == "Ready" and r.waits_for is None and report.headline.endswith("its claims:")


def test_a_deleted_domain_is_said_the_pod_can_never_start() -> None:
    claim = channel_claim("job-channel-x", JOB, "a1", "worker-0")
    report, (d,) = _why(workload_pod("worker-0", "a1", "job-channel-x"), claim, [], node_slices("a1"))
    assert d.status == "missing" and d.domain == "UID d-1"
    assert "does not exist in namespace ml: it was deleted" in report.headline
    assert "can never start" in report.headline


def test_a_node_of_another_clique_than_the_domains_nodes_is_refused_naming_both() -> None:
    claim = channel_claim("job-channel-x", JOB, "b1", "worker-9")
    report, (d,) = _why(workload_pod("worker-9", "b1", "job-channel-x"), claim, [JOB],
                        node_slices("b1", CLIQUE_B))
    assert d.waits_for is not None and "cannot span two cliques" in d.waits_for
    assert CLIQUE_A in report.headline and CLIQUE_B in report.headline and "node b1" in report.headline


def test_no_node_with_a_channel_says_why_the_channel_claim_cannot_be_allocated() -> None:
    report, (d,) = _why(workload_pod("worker-0", None, None), None, [JOB], node_slices("n", channel=False))
    assert d.claim is None and d.node is None
    assert d.waits_for is not None and d.waits_for.startswith("no node publishes an IMEX channel")
    assert "--compute-domains" in report.headline
    # with a channel somewhere, a pending pod waits for the scheduler, not for its domain
    _, (e,) = _why(workload_pod("worker-0", None, None), None, [JOB], node_slices("a1"))
    assert e.waits_for is None and e.status == "NotReady"


def test_a_pod_without_a_channel_claim_has_no_domain_and_a_gpu_config_is_no_channel() -> None:
    gpu_claim: JSON = {"metadata": {"namespace": NS, "name": "g"}, "spec": {"devices": {
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}],
        "config": [{"opaque": {"driver": DRIVER, "parameters": {"kind": "GpuConfig"}}}]}}}
    assert domain_ref(gpu_claim) is None
    assert domain_reports(workload_pod("p", None, "g"), [PodClaim("gpu", gpu_claim)], [JOB], []) == ()
    ref = domain_ref(channel_claim("c", JOB, None, "p"))
    assert ref is not None and (ref.driver, ref.uid) == (DRIVER, "d-1")


def test_kubectl_gpu_why_reads_the_domains_of_the_pods_namespace_only_for_a_channel_claim(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    claim = channel_claim("job-channel-x", JOB, "a1", "worker-0")
    objects: dict[str, JSON] = {
        f"/api/v1/namespaces/{NS}/pods/worker-0": workload_pod("worker-0", "a1", "job-channel-x"),
        f"/api/v1/namespaces/{NS}/pods/plain": {"metadata": {"namespace": NS, "name": "plain"}, "spec": {}},
        f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/job-channel-x": claim,
        "/apis/resource.k8s.io/v1/resourceslices": {"items": node_slices("a1")},
        domains_path(DRIVER, NS): {"items": [JOB]},
    }
    asked: list[str] = []

    async def request(api: object, method: str, path: str, **_: Any) -> JSON:
        asked.append(path)
        if path not in objects and not path.endswith(("/nodes", "/deviceclasses", "/resourceclaims")):
            raise kube.ApiException(404, "Not Found", "the server could not find the requested resource")
        return objects.get(path, {"items": []})

    await_client(monkeypatch)
    monkeypatch.setattr(kube, "request", request)
    for pod, code in (("worker-0", 0), ("plain", 0)):
        monkeypatch.setattr(sys, "argv", ["kubectl-gpu", "why", f"{NS}/{pod}"])
        with pytest.raises(SystemExit) as done:
            status.main()
        assert done.value.code == code
    out = capsys.readouterr().out
    assert f"waits for ComputeDomain {NS}/job: 2 of spec.numNodes 3 nodes have joined" in out
    assert f"ComputeDomain {NS}/job (claim channel): NotReady, numNodes 3, 2 joined" in out
    assert "  not ready: a2" in out and "  the pod's node a1: Ready" in out
    assert asked.count(domains_path(DRIVER, NS)) == 1, "read for the channel pod only"


def test_the_names_written_again_for_a_cheap_import_agree_with_the_driver_and_the_controller() -> None:
    from dra_driver.commands import domains
    from dra_driver.imex import channels

    assert domains.CHANNEL_TYPE == channels.CHANNEL_TYPE
    assert domains.CONFIG_KIND == channels.CONFIG_KIND == cdc.CHANNEL_CONFIG_KIND
    assert domains.CONFIG_PREFIX + DRIVER == channels.config_driver(DRIVER) == cdc.channel_driver(DRIVER)
    assert domains.api_version(DRIVER) == cdc.api_version(DRIVER)
