"""The pure parts of benchmarks/scheduler.py: what it publishes, how many pods it asks for, and
how it reads the scheduler's metrics. The figures themselves are never asserted here."""

from __future__ import annotations

from benchmarks.scheduler import (
    SHAPES,
    attempts,
    capacity,
    fleet_of,
    node_objects,
    parse_metrics,
    reference_specs,
    scheduled,
    sli_summary,
)
from controller.plan import PoolSpec, desired_objects
from controller.slices import SliceFeatures, desired_slices
from dra_driver.gpu import discover

METRICS = """\
# HELP scheduler_schedule_attempts_total Number of attempts to schedule pods
scheduler_schedule_attempts_total{profile="default-scheduler",result="scheduled"} 7
scheduler_schedule_attempts_total{profile="default-scheduler",result="unschedulable"} 3
scheduler_pod_scheduling_sli_duration_seconds_bucket{attempts="1",le="0.01"} 1
scheduler_pod_scheduling_sli_duration_seconds_bucket{attempts="1",le="0.1"} 5
scheduler_pod_scheduling_sli_duration_seconds_bucket{attempts="1",le="+Inf"} 7
scheduler_pod_scheduling_sli_duration_seconds_sum{attempts="1"} 0.7
scheduler_pod_scheduling_sli_duration_seconds_count{attempts="1"} 7
scheduler_queue_incoming_pods_total{event="PodAdd",queue="active"} 99
"""

SHAPE = {s.name: s for s in SHAPES}


def test_metrics_read_as_the_scheduler_reports_them() -> None:
    samples = parse_metrics(METRICS, ("scheduler_schedule_attempts_total",
                                      "scheduler_pod_scheduling_sli_duration_seconds"))
    assert scheduled(samples) == 7
    assert attempts(samples) == {"scheduled": 7, "unschedulable": 3}
    assert not any(name.startswith("scheduler_queue") for name, _ in samples)
    assert sli_summary(samples) == {"count": 7, "mean_s": 0.1, "p50_le_s": 0.1, "p99_le_s": float("inf")}


def test_an_empty_histogram_has_no_quantiles() -> None:
    assert sli_summary({}) == {"count": 0, "mean_s": None, "p50_le_s": None, "p99_le_s": None}


def test_reference_devices_carry_only_the_upstream_benchmark_fields() -> None:
    (spec,) = reference_specs(discover("hgx-h200"), "n1")
    assert len(spec["devices"]) == 8
    for device in spec["devices"]:
        assert set(device["attributes"]) == {"index", "uuid", "productName"}
        assert set(device["capacity"]) == {"memory"}


def test_our_slices_are_the_publishers() -> None:
    inventory = discover("dgx1-v100")
    specs = desired_slices(inventory, "n1", "gpu.dra-driver.dev", SliceFeatures(list_attributes=True))
    expected = list(desired_objects("gpu.dra-driver.dev", PoolSpec("n1", "n1", specs), 1, None).values())
    assert node_objects("ours", inventory, "n1") == expected
    shares = node_objects("shares", inventory, "n1")
    assert any(d.get("allowMultipleAllocations") for o in shares for d in o["spec"].get("devices", []))
    only = node_objects("shares-only", inventory, "n1")
    devices = [d for o in only for d in o["spec"].get("devices", [])]
    assert [d["name"] for d in devices] == [f"gpu-{i}-share" for i in range(8)]
    assert not any("consumesCounters" in d for d in devices)


def test_pods_asked_for_fit_the_fleet() -> None:
    fleet = fleet_of("mixed", 4)  # two hgx-h200 (141 GB) and two dgx1-v100 (32 GB), 8 GPUs each
    assert capacity(SHAPE["one-gpu"], fleet) == 32
    assert capacity(SHAPE["pair"], fleet) == 16
    assert capacity(SHAPE["quad"], fleet) == 8
    assert capacity(SHAPE["share"], fleet) == 2 * 8 * 17 + 2 * 8 * 3  # 8Gi shares
    assert capacity(SHAPE["share-only"], fleet) == capacity(SHAPE["share"], fleet)


def test_linked_shapes_are_the_documented_eight_layers() -> None:
    for name, k in (("pair", 2), ("quad", 4)):
        (request,) = SHAPE[name].claim["requests"]
        assert [s["count"] for s in request["firstAvailable"]] == [k] * 8
        assert len(SHAPE[name].claim["constraints"]) == 8


def test_fill_gives_every_shape_the_same_fraction_of_what_the_fleet_holds() -> None:
    from benchmarks.scheduler import for_fleet, pods_for

    fleet = fleet_of("dgx1-v100", 500)
    assert pods_for(SHAPE["reference"], fleet, 400, 0.1) == 400  # 10% of 4,000 GPUs
    assert pods_for(SHAPE["reference"], fleet, 5000, 0.1) == 400
    assert pods_for(for_fleet(SHAPE["linked4"], fleet), fleet, 400, 0.1) == 100  # 2 quads a node
    assert pods_for(for_fleet(SHAPE["linked4"], fleet), fleet, 400) == 400  # no fill: as many as asked
    assert pods_for(for_fleet(SHAPE["impossible"], fleet), fleet, 400, 0.1) == 100  # never capped by fill


def test_linked_shapes_are_built_for_the_fleet_and_sized_to_the_most_linked_sets() -> None:
    from benchmarks.scheduler import for_fleet, largest_clique, model_bound, most_linked_sets, node_specs
    from controller.attributes import LEGACY_ATTRIBUTES, NVLINK_CLIQUE_SIZE, TOPOLOGY_DETAIL_ATTRIBUTES

    dgx1 = fleet_of("dgx1-v100", 3)
    assert largest_clique(dgx1) == 4 and most_linked_sets(discover("dgx1-v100"), 4) == 2
    quads = for_fleet(SHAPE["linked4"], dgx1)
    assert capacity(quads, dgx1) == 6 and model_bound(quads, dgx1, 6) == 6  # 2 quads a node, both found
    impossible = for_fleet(SHAPE["impossible"], dgx1)
    assert impossible.gpus == 5 and capacity(impossible, dgx1) == 100
    (sub,) = impossible.claim["requests"][0]["firstAvailable"]
    assert sub["deviceClassName"] == "gpu-linked.gpu.dra-driver.dev"  # groups of 4: the fail-fast selector
    assert "nvlinkCliqueSize" in sub["selectors"][0]["cel"]["expression"]
    (sel,) = for_fleet(SHAPE["impossible-sel"], dgx1).claim["requests"][0]["firstAvailable"]
    assert sel["deviceClassName"] == "gpu.dra-driver.dev"
    assert "nvlinkCliqueSize" in sel["selectors"][0]["cel"]["expression"]
    eight = for_fleet(SHAPE["pair-linked"], dgx1).claim["requests"][0]["firstAvailable"]
    assert len(eight) == 8 and {s["deviceClassName"] for s in eight} == {"gpu-linked.gpu.dra-driver.dev"}
    before = for_fleet(SHAPE["impossible-before"], dgx1)
    assert len(before.claim["requests"][0]["firstAvailable"]) == 8
    assert not any("selectors" in s for s in before.claim["requests"][0]["firstAvailable"])
    random1 = fleet_of("random-1", 2)  # largest clique 2: no triple, pairs in 4 layers
    assert largest_clique(random1) == 2 and capacity(for_fleet(SHAPE["linked3"], random1), random1) == 0
    old = node_specs("before", discover("hgx-h200"), "n")[0]["devices"][0]["attributes"]
    new = node_specs("ours", discover("hgx-h200"), "n")[0]["devices"][0]["attributes"]
    assert NVLINK_CLIQUE_SIZE in new and NVLINK_CLIQUE_SIZE not in old
    assert LEGACY_ATTRIBUTES & set(old) and not LEGACY_ATTRIBUTES & set(new)
    assert set(old) >= TOPOLOGY_DETAIL_ATTRIBUTES and not TOPOLOGY_DETAIL_ATTRIBUTES & set(new)
