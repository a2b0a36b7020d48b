"""The demo's report (demo.report, pure): what it counts as a problem and what it prints.

A container that lists another GPU than it was allocated, a pod that should run and does
not, and the one pod meant to stay pending are told apart; the in-container listing and
the NVLink clique attributes appear as the demo prints them. No cluster: made-up views.
"""

from __future__ import annotations

from dataclasses import replace

from demo.report import (
    ClaimView,
    ContainerView,
    DemoReport,
    DeviceView,
    ExampleView,
    NodeView,
    PodView,
    all_linked,
    counts,
    listed_devices,
    render,
)

LISTING = (
    "crw-rw-rw-    1 root     root      238,   0 Dec  3 06:40 /dev/nvidia-uvm",
    "crw-rw-rw-    1 root     root      195,   4 Dec  3 06:40 /dev/nvidia4",
    "crw-rw-rw-    1 root     root      195,   5 Dec  3 06:40 /dev/nvidia5",
    "crw-rw-rw-    1 root     root      195, 255 Dec  3 06:40 /dev/nvidiactl",
)


def gpu(n: int) -> DeviceView:
    return DeviceView(
        request="gpus/layer0",
        pool="dgx1-v100",
        device=f"gpu-{n}",
        product="Tesla V100-SXM2-32GB",
        memory="32510Mi",
        index=n,
        minor=n,
        nvlink_cliques=("nvlinkClique0=4-5-6-7", f"nvlinkClique1={n - 4}-{n}"),
        nvlink_domain="",
        nvlink_peers=tuple(i for i in range(8) if i != n),
    )


def pod(name: str, container: ContainerView, phase: str = "Running") -> PodView:
    claim = ClaimView(f"{name}-gpus", "template", container.allocated, (f"gpu-demo/{name}",))
    return PodView("gpu-demo", name, "dgx1-v100", phase, (container,), (claim,))


def report(*pods: PodView) -> DemoReport:
    reason = "FailedScheduling: 0/3 nodes. More"
    pending = PodView("gpu-demo", "too-big", None, "Pending", pending_reason=reason)
    return DemoReport(
        kubernetes_version="v1.37.2",
        nodes=(NodeView("dgx1-v100", "dgx1-v100", 8, "Tesla V100-SXM2-32GB", "cube-mesh"),),
        examples=(ExampleView("05.yaml", "a pair", (*pods, pending)),),
        expected_pending=("gpu-demo/too-big",),
        cdi_spec_files=1,
    )


def test_listing_is_parsed_into_device_nodes() -> None:
    nodes = listed_devices(LISTING)
    assert [(d.path, d.major, d.minor) for d in nodes] == [
        ("/dev/nvidia-uvm", 238, 0),
        ("/dev/nvidia4", 195, 4),
        ("/dev/nvidia5", 195, 5),
        ("/dev/nvidiactl", 195, 255),
    ]
    container = ContainerView("main", "Running", (gpu(4), gpu(5)), listing=LISTING)
    assert container.seen_minors == (4, 5) and container.sees_exactly_its_gpus


def test_a_matching_run_has_no_problems_and_prints_the_listing() -> None:
    ok = pod("pair", ContainerView("main", "Running", (gpu(4), gpu(5)), (("cdi-4", "Healthy"),), LISTING))
    r = report(ok)
    assert counts(r).ok
    text = render(r)
    assert LISTING[1] in text
    assert "= exactly the allocated GPUs, by minor number: gpu-4 gpu-5" in text
    assert "nvlinkClique0=4-5-6-7 nvlinkClique1=0-4" in text
    summary = text.rstrip().splitlines()[-1]
    assert summary.startswith("2 pods: 1 Running, 1 Pending on purpose (gpu-demo/too-big Pending: Failed")
    assert "1 of 1 GPU containers list exactly their allocated GPUs; no problems" in summary


def test_wrong_gpu_and_a_pod_that_does_not_run_are_problems() -> None:
    wrong = pod("wrong", ContainerView("main", "Running", (gpu(6),), listing=LISTING))
    stuck = pod("stuck", ContainerView("main", "waiting (ContainerCreating)", (gpu(7),)), phase="Pending")
    c = counts(report(wrong, stuck))
    assert not c.ok and c.problems == 2
    text = render(report(wrong, stuck))
    assert "MISMATCH: allocated /dev/nvidia6, the container lists /dev/nvidia4 /dev/nvidia5" in text
    assert "1 NOT Running (gpu-demo/stuck Pending)" in text


def test_linked_without_peers_when_the_devices_share_a_clique_layer_group() -> None:
    # the slices publish nvlinkPeers only with --topology-detail-attributes; one layer group is enough
    bare = [replace(gpu(n), nvlink_peers=()) for n in (4, 5)]
    assert all_linked(bare) is True
    apart = [replace(gpu(4), nvlink_peers=(), nvlink_cliques=("nvlinkClique0=0-4",)),
             replace(gpu(6), nvlink_peers=(), nvlink_cliques=("nvlinkClique0=2-6",))]
    assert all_linked(apart) is False
    assert all_linked([replace(apart[0], nvlink_peers=(6,)), apart[1]]) is True  # the claim status's peers


def test_the_demo_reads_nvlink_peers_from_the_claim_status_when_the_slice_has_none() -> None:
    from demo.run import _status_peers, device_view

    data = {"nvlinkPeers": [{"gpu": "gpu-3", "uuid": "GPU-3"}, {"gpu": "gpu-1", "uuid": "GPU-1"}]}
    assert _status_peers(data) == (1, 3)
    device = {"attributes": {"index": {"int": 0}, "nvlinkClique0": {"string": "0-1"}}}
    result = {"request": "r", "pool": "p", "device": "gpu-0"}
    view = device_view(result, device, (), None, _status_peers(data))
    assert view.nvlink_peers == (1, 3) and view.nvlink_cliques == ("nvlinkClique0=0-1",)
