"""dra_driver.explain on slices as the driver publishes them (controller.slices) and claims
allocated by hand: the CEL shim, the allocator's search and the lines a person reads.

The cases with a known scheduler answer are those tests/integration/test_nvlink_claims.py
and test_dynamic_mig.py check against the real kube-scheduler; tests/integration/
test_explain_agrees.py compares the two at random.
"""

from __future__ import annotations

import pytest

from controller.claim_shapes import linked_gpus_ga, linked_gpus_list
from controller.slices import SliceFeatures, desired_slices
from dra_driver.explain.celenv import compile_selector, device_variable, evaluate
from dra_driver.explain.render import render
from dra_driver.explain.why import PodClaim, PodReport, explain_pod
from dra_driver.gpu import discover
from dra_driver.jsontypes import JSON

D = "gpu.dra-driver.dev"
A = f'device.attributes["{D}"]'
CLASSES = {
    "gpu": {
        "metadata": {"name": "gpu"},
        "spec": {"selectors": [{"cel": {"expression": f'{A}.type == "gpu"'}}]},
    },
    "share": {
        "metadata": {"name": "share"},
        "spec": {"selectors": [{"cel": {"expression": f'{A}.type == "gpu-share"'}}]},
    },
    "mig": {
        "metadata": {"name": "mig"},
        "spec": {"selectors": [{"cel": {"expression": f'{A}.type == "mig" && !("uuid" in {A})'}}]},
    },
}


def _slices(node: str, profile: str, features: SliceFeatures | None = None) -> list[JSON]:
    specs = desired_slices(discover(profile), node, D, features or SliceFeatures())
    return [
        {
            "metadata": {"name": f"{node}-{n}"},
            "spec": {**s, "pool": {**s["pool"], "generation": 1, "resourceSliceCount": len(specs)}},
        }
        for n, s in enumerate(specs)
    ]


def _node(name: str) -> JSON:
    return {"metadata": {"name": name, "labels": {}}, "spec": {}}


def _held(node: str, *devices: str, name: str = "busy", share: str | None = None) -> JSON:
    results = []
    for d in devices:
        result: JSON = {"request": "r", "driver": D, "pool": node, "device": d}
        if share:
            result |= {
                "shareID": "8d7c9a30-1b2c-4d5e-8f90-a1b2c3d4e5f6",
                "consumedCapacity": {"memory": share},
            }
        results.append(result)
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": name},
        "status": {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": "x"}],
        },
    }


def _explain(slices: list[JSON], nodes: list[str], devices: JSON, held: list[JSON]) -> PodReport:
    pod = {
        "metadata": {"namespace": "ns", "name": "p"},
        "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimName": "c"}]},
    }
    claim = {"metadata": {"namespace": "ns", "name": "c", "uid": "c"}, "spec": {"devices": devices}}
    return explain_pod(pod, [PodClaim("gpus", claim)], [_node(n) for n in nodes], slices, CLASSES, held)


def _line(report: PodReport, node: str) -> str:
    (found,) = [n for n in report.nodes if n.node == node]
    return found.summary


# --------------------------------------------------------------------------- CEL


@pytest.mark.parametrize(
    ("expression", "matches"),
    [
        (f'{A}.type == "gpu" && device.driver == "{D}"', True),
        (f'device.capacity["{D}"].memory.compareTo(quantity("140Gi")) >= 0', True),
        (f'device.capacity["{D}"].memory.isGreaterThan(quantity("141Gi"))', False),
        (f'{A}.driverVersion.isGreaterThan(semver("550.0.0")) && {A}.driverVersion.major() == 570', True),
        (f'{A}.cudaComputeCapability.isLessThan(semver("9.0", true))', False),
        ('"x" in device.attributes["other.example.com"]', True is False),  # an unknown domain is an empty map
        (f'{A}.productName.lowerAscii().contains("h200")', True),
        (f"{A}.?migMode.orValue(false) == false", True),
        (f"cel.bind(a, {A}, a.index == 0)", True),
        ('quantity("1Gi").add(quantity("1Gi")).compareTo(quantity("2048Mi")) == 0', True),
        ('semver("1.0.0-rc.1").isLessThan(semver("1.0.0"))', True),
    ],
)
def test_selectors_evaluate_as_the_scheduler_does(expression: str, matches: bool) -> None:
    device = _slices("n", "hgx-h200")[0]["spec"]["devices"][0]
    outcome = evaluate(compile_selector(expression), device_variable(D, device))
    assert outcome == type(outcome)(matches), outcome


def test_a_missing_attribute_is_a_runtime_error_as_in_the_scheduler() -> None:
    device = _slices("n", "hgx-h200")[0]["spec"]["devices"][0]
    outcome = evaluate(compile_selector(f"{A}.noSuchAttribute == 1"), device_variable(D, device))
    assert not outcome.matches and outcome.error and "noSuchAttribute" in outcome.error


# --------------------------------------------------------------------------- NVLink


def test_fragmented_ring_pair_found_on_the_second_layer() -> None:
    # test_nvlink_claims: 0, 3-7 busy; the scheduler gives 1-2 from layer 1
    report = _explain(
        _slices("ring", "ring8-v100"),
        ["ring"],
        linked_gpus_ga(2, driver=D, device_class="gpu"),
        [_held("ring", "gpu-0", "gpu-3", "gpu-4", "gpu-5", "gpu-6", "gpu-7")],
    )
    assert report.fitting == ("ring",)
    assert _line(report, "ring") == "ring: fits: gpus/layer1 gets gpu-1, gpu-2"


def test_ring_with_no_linked_free_pair_says_so() -> None:
    report = _explain(
        _slices("ring", "ring8-v100"),
        ["ring"],
        linked_gpus_ga(2, driver=D, device_class="gpu"),
        [_held("ring", "gpu-0", "gpu-2", "gpu-4", "gpu-6")],
    )
    assert report.fitting == ()
    line = _line(report, "ring")
    assert line.startswith("ring: 2 linked GPUs asked; 8 match (4 held by ns/busy for ns/busy-pod"), line
    assert line.endswith("free gpu-1, gpu-3, gpu-5, gpu-7; largest linked free set 1"), line


def test_triangles_list_shape() -> None:
    slices = _slices("tri", "bridged-triangles-v100", SliceFeatures(list_attributes=True))
    busy = [_held("tri", "gpu-2", "gpu-3")]
    assert _explain(slices, ["tri"], linked_gpus_list(3, driver=D, device_class="gpu"), busy).fitting == ()
    report = _explain(slices, ["tri"], linked_gpus_list(2, driver=D, device_class="gpu"), busy)
    assert report.fitting == ("tri",)


# --------------------------------------------------------------------------- MIG and shares


def _mig(profile: str, count: int = 1) -> JSON:
    selectors = [{"cel": {"expression": f'{A}.profile == "{profile}" && {A}.parentIndex == 0'}}]
    return {
        "requests": [
            {"name": "mig", "exactly": {"deviceClassName": "mig", "count": count, "selectors": selectors}}
        ]
    }


def test_a_3g_waits_for_its_four_memory_slices() -> None:
    # test_dynamic_mig: seven 1g on GPU 0; freeing 4 and 5 is not enough, freeing 6 too is
    slices = _slices("mig", "hgx-h200-mig", SliceFeatures(dynamic_mig=True))
    ones = [f"gpu-0-mig-1g-18gb-19-{s}" for s in range(7)]
    held = [_held("mig", d, name=f"one{n}") for n, d in enumerate(ones)]
    report = _explain(slices, ["mig"], _mig("3g.71gb"), held)
    assert report.fitting == ()
    line = _line(report, "mig")
    assert "1 MIG slice 3g.71gb asked; 2 match (2 blocked by held MIG slices); none free" in line, line
    assert _explain(slices, ["mig"], _mig("3g.71gb"), held[:4] + held[6:]).fitting == ()
    report = _explain(slices, ["mig"], _mig("3g.71gb"), held[:4])
    assert [n.allocation for n in report.nodes] == [("mig: gpu-0-mig-3g-71gb-9-4",)]


def test_whole_gpu_in_mig_mode_with_a_held_slice_is_blocked() -> None:
    slices = _slices("mig", "hgx-h200-mig", SliceFeatures(dynamic_mig=True))
    whole = {
        "requests": [
            {
                "name": "gpu",
                "exactly": {
                    "deviceClassName": "gpu",
                    "selectors": [{"cel": {"expression": f"{A}.index == 0"}}],
                },
            }
        ]
    }
    report = _explain(slices, ["mig"], whole, [_held("mig", "gpu-0-mig-2g-35gb-14-0")])
    (node,) = report.nodes
    (request,) = node.requests
    assert request.mig_mode == ("gpu-0",) and len(request.counters) == 1
    assert "held by gpu-0-mig-2g-35gb-14-0 (1 claim: ns/busy)" in request.counters[0]


def test_a_share_bigger_than_what_is_left() -> None:
    slices = _slices("one", "h200-single", SliceFeatures(memory_shares=True))
    share: JSON = {
        "requests": [
            {
                "name": "mem",
                "exactly": {"deviceClassName": "share", "capacity": {"requests": {"memory": "100Gi"}}},
            }
        ]
    }
    report = _explain(slices, ["one"], share, [_held("one", "gpu-0-share", share="64Gi")])
    assert report.fitting == ()
    assert "short of capacity" in _line(report, "one") and "most left: 76.4Gi memory left on gpu-0-share" in (
        _line(report, "one")
    ), _line(report, "one")
    share["requests"][0]["exactly"]["capacity"]["requests"]["memory"] = "76Gi"
    assert _explain(slices, ["one"], share, [_held("one", "gpu-0-share", share="64Gi")]).fitting == ("one",)


# --------------------------------------------------------------------------- the pod


def test_a_bound_pod_says_where_its_claims_are() -> None:
    pod = {
        "metadata": {"namespace": "ns", "name": "p"},
        "spec": {"nodeName": "ring", "resourceClaims": [{"name": "gpus", "resourceClaimName": "busy"}]},
    }
    claim = _held("ring", "gpu-1")
    claim["status"]["allocation"]["nodeSelector"] = {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["ring"]}]}
        ]
    }
    report = explain_pod(pod, [PodClaim("gpus", claim)], [_node("ring")], [], CLASSES, [claim])
    text = render(report)
    assert "pod ns/p is bound to node ring" in text and "gpus (ns/busy): allocated on ring: gpu-1 (r)" in text


def test_nodes_the_pod_cannot_use_are_not_considered_and_closest_come_first() -> None:
    slices = _slices("ring", "ring8-v100") + _slices("nvs", "hgx-h200")
    held = [
        _held("ring", "gpu-0", "gpu-2", "gpu-4", "gpu-6"),
        _held("nvs", *[f"gpu-{i}" for i in range(8)], name="all"),
    ]
    report = _explain(slices, ["nvs", "ring"], linked_gpus_ga(2, driver=D, device_class="gpu"), held)
    assert [n.node for n in report.nodes] == ["ring", "nvs"]  # ring has free GPUs, nvs none
    assert "none free" in _line(report, "nvs")


# --------------------------------------------------------------------------- what the scheduler reads


def _one(
    n: int = 1, *, admin: bool = False, tolerations: list[JSON] | None = None, name: str = "gpu"
) -> JSON:
    exactly: JSON = {"deviceClassName": "gpu", "count": n}
    if admin:
        exactly["adminAccess"] = True
    if tolerations:
        exactly["tolerations"] = tolerations
    return {"name": name, "exactly": exactly}


def _rule(name: str, selector: JSON | None, effect: str = "NoSchedule") -> JSON:
    spec: JSON = {"taint": {"key": "example.com/maintenance", "value": "", "effect": effect}}
    if selector is not None:
        spec["deviceSelector"] = selector
    return {"metadata": {"name": name}, "spec": spec}


def _pod(**spec: JSON) -> JSON:
    claims = [{"name": "gpus", "resourceClaimName": "c"}]
    return {"metadata": {"namespace": "ns", "name": "p"}, "spec": {"resourceClaims": claims, **spec}}


def _claim(devices: JSON) -> PodClaim:
    meta = {"namespace": "ns", "name": "c", "uid": "c"}
    return PodClaim("gpus", {"metadata": meta, "spec": {"devices": devices}})


def _explain_with(slices: list[JSON], nodes: list[str], devices: JSON, held: list[JSON],
                  rules: list[JSON]) -> PodReport:
    return explain_pod(_pod(), [_claim(devices)], [_node(n) for n in nodes], slices, CLASSES, held, rules)


def test_a_device_taint_rule_taints_the_devices_it_selects() -> None:
    """The scheduler's slice tracker adds a rule's taint to every device of the driver, pool and
    device name it names; with the only free GPU tainted, the claim fits nowhere."""
    slices = _slices("l4", "l4x4")
    busy = [_held("l4", "gpu-0", "gpu-1", "gpu-2")]
    claim = {"requests": [_one()]}
    assert _explain_with(slices, ["l4"], claim, busy, []).fitting == ("l4",)
    rule = _rule("drain-gpu-3", {"driver": D, "pool": "l4", "device": "gpu-3"})
    report = _explain_with(slices, ["l4"], claim, busy, [rule])
    assert report.fitting == ()
    assert "1 tainted" in _line(report, "l4"), _line(report, "l4")
    (request,) = report.nodes[0].requests
    assert request.tainted == ("gpu-3 (example.com/maintenance=:NoSchedule, DeviceTaintRule drain-gpu-3)",)
    # what the rule does not select, a taint with no effect on scheduling, a toleration
    for other in (
        _rule("other-pool", {"pool": "elsewhere"}),
        _rule("other-driver", {"driver": "other.example.com"}),
        _rule("no-selector", None),
        _rule("none", {"driver": D}, effect="None"),
    ):
        assert _explain_with(slices, ["l4"], claim, busy, [other]).fitting == ("l4",), other
    tolerant = {"requests": [_one(tolerations=[{"key": "example.com/maintenance", "operator": "Exists"}])]}
    assert _explain_with(slices, ["l4"], tolerant, busy, [rule]).fitting == ("l4",)
    every = _rule("all", {})  # the empty selector selects every device
    assert _explain_with(slices, ["l4"], claim, [], [every]).fitting == ()


def test_admin_access_takes_held_devices_but_not_one_device_twice_in_a_claim() -> None:
    slices = _slices("one", "h200-single")
    monitor = _held("one", "gpu-0", name="monitor")
    monitor["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    # a claim with adminAccess holds nothing: a plain claim still gets the GPU
    assert _explain([*slices], ["one"], {"requests": [_one()]}, [monitor]).fitting == ("one",)
    busy = [_held("one", "gpu-0")]
    assert _explain(slices, ["one"], {"requests": [_one()]}, busy).fitting == ()
    assert _explain(slices, ["one"], {"requests": [_one(admin=True)]}, busy).fitting == ("one",)
    # the allocator never gives one device twice to the same claim, adminAccess or not
    twice = {"requests": [_one(admin=True, name="a"), _one(admin=True, name="b")]}
    assert _explain(slices, ["one"], twice, busy).fitting == ()


def test_a_linked_request_does_not_call_unlinked_gpus_free() -> None:
    """PCIe L4s are in no NVLink clique: the allocator never takes them for a linked request."""
    report = _explain(_slices("l4", "l4x4"), ["l4"], linked_gpus_ga(2, driver=D, device_class="gpu"), [])
    assert report.fitting == ()
    for request in report.nodes[0].requests:  # one per clique layer
        assert request.free == () and len(request.lacking) == 4, request
    line = _line(report, "l4")
    assert "4 match (4 in no linked set); none free" in line, line


def test_a_selector_that_fails_to_evaluate_is_said_once() -> None:
    bad = [{"cel": {"expression": f"{A}.noSuchAttribute == 1"}}]
    classes = {**CLASSES, "bad": {"metadata": {"name": "bad"}, "spec": {"selectors": bad}}}
    claim = _claim({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "bad"}}]})
    slices = _slices("a", "hgx-h200") + _slices("b", "hgx-h200")
    report = explain_pod(_pod(), [claim], [_node("a"), _node("b")], slices, classes, [])
    assert "fails to evaluate on 2 of them" in report.headline, report.headline
    assert "noSuchAttribute" in report.headline and "no node has a device that matches" not in report.headline
    text = render(report, verbose=True)
    assert text.count("Key not found") == 1 + 2 * 2, text  # the headline; per node its line and detail
    (request,) = report.nodes[0].requests
    assert len(request.errors) == 1 and request.error_devices == 8


def test_when_no_node_is_considered_the_reasons_are_shown_without_all() -> None:
    pod = _pod(nodeSelector={"gpu": "h100"})
    claim = _claim({"requests": [_one()]})
    report = explain_pod(pod, [claim], [_node("a"), _node("b")], _slices("a", "l4x4"), CLASSES, [])
    assert report.headline == (
        "pod ns/p: no node is considered for it: nodeSelector gpu=h100 does not match (2 nodes)")
    text = render(report)
    assert "Nodes, none considered:" in text and "a: not considered: nodeSelector gpu=h100" in text, text


def test_closest_first_puts_nodes_without_a_device_of_the_class_last() -> None:
    """A node whose GPUs are all held is closer than one with no device of the class at all."""
    shared = _slices("b-shared", "h200-single", SliceFeatures(memory_shares=True))
    slices = _slices("a-plain", "l4x4") + shared
    share = {"requests": [{"name": "mem", "exactly": {"deviceClassName": "share",
                                                       "capacity": {"requests": {"memory": "100Gi"}}}}]}
    held = [_held("b-shared", "gpu-0-share", share="64Gi")]
    report = _explain(slices, ["a-plain", "b-shared"], share, held)
    assert [n.node for n in report.nodes] == ["b-shared", "a-plain"], [n.summary for n in report.nodes]


# --------------------------------------------------------------------------- the command


def test_kubectl_gpu_why_reads_the_cluster_and_prints_the_explanation(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys
    from typing import Any

    from dra_driver import kube
    from dra_driver.commands import status

    slices = _slices("ring", "ring8-v100")
    busy = _held("ring", "gpu-0", "gpu-2", "gpu-4", "gpu-6")
    claim = {
        "metadata": {"namespace": "ns", "name": "c", "uid": "c"},
        "spec": {"devices": linked_gpus_ga(2, driver=D, device_class="gpu")},
    }
    pod = {
        "metadata": {"namespace": "ns", "name": "p"},
        "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimName": "c"}]},
    }
    objects: dict[str, JSON] = {
        "/api/v1/namespaces/ns/pods/p": pod,
        "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c": claim,
        "/api/v1/nodes": {"items": [_node("ring")]},
        "/apis/resource.k8s.io/v1/resourceslices": {"items": slices},
        "/apis/resource.k8s.io/v1/deviceclasses": {"items": list(CLASSES.values())},
        "/apis/resource.k8s.io/v1/resourceclaims": {"items": [busy, claim]},
        # served at an older version only: the command falls back to it
        "/apis/resource.k8s.io/v1alpha3/devicetaintrules": {"items": [_rule("r", {"device": "gpu-1"})]},
    }

    class Api:
        async def close(self) -> None:
            pass

    async def load_client(kubeconfig: str | None = None) -> Api:
        return Api()

    async def request(api: object, method: str, path: str, **_: Any) -> JSON:
        assert method == "GET"
        if path not in objects:
            raise kube.ApiException(404, "Not Found", "the server could not find the requested resource")
        return objects[path]

    monkeypatch.setattr(kube, "load_client", load_client)
    monkeypatch.setattr(kube, "request", request)
    monkeypatch.setattr(sys, "argv", ["kubectl-gpu", "why", "ns/p"])
    capsys.readouterr()  # discovery's log lines
    with pytest.raises(SystemExit) as done:
        status.main()
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("pod ns/p: its claims fit on none of 1 nodes considered"), out
    assert "1 tainted); free gpu-3, gpu-5, gpu-7; largest linked free set 1" in out  # the rule on gpu-1
    assert "DeviceTaintRule r" not in out and "1 tainted" in out
