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
