"""The driver's Prometheus metrics: one registry, one object per metric, used by every part.

Other modules import the objects and count (`metrics.health_events.labels(kind="xid").inc()`);
`dra_driver.probes` serves `REGISTRY` on the metrics port. The names follow the
`gpu_dra_` prefix; the label values are a closed set each (listed per metric), so a
label never carries a claim or device name and the series count stays bounded. The one
exception is `gpu_dra_device_claim_info`: one series per prepared device and pod, removed
at Unprepare, so it is bounded by what the node holds now (it exists to be joined with
DCGM's per-GPU series by UUID). It names claims, their UIDs and pods to whoever can reach
the metrics port, so `SERVED`, what the port serves, leaves it out unless
`serve_claim_identity(True)` (`--claim-identity-metric`, chart value
metrics.claimIdentity): off by default, since the chart's NetworkPolicy is off by default
and works only where the network plugin enforces it. REGISTRY itself always has it.

This module only defines the metrics and the few helpers that record them; it never
serves them, never starts a thread and never does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Final, Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Metric,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.registry import Collector

from dra_driver import __version__

__all__ = [
    "REGISTRY",
    "SERVED",
    "Operation",
    "api_error",
    "api_errors",
    "build_info",
    "claims",
    "device_claim_info",
    "devices_published",
    "features_off",
    "health_events",
    "health_monitor_waits",
    "prepared_claims",
    "request_duration",
    "requests_inflight",
    "serve_claim_identity",
    "slice_conflicts",
    "slice_writes",
    "timed_request",
]

Operation = Literal["prepare", "unprepare"]

# Its own registry (not the client library's global one), so that tests and a second
# daemon in one process never see each other's series; process and Python metrics added.
REGISTRY: Final = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

# Fine buckets for a Prepare on a healthy node, coarse ones up to the kubelet's 45 s, which
# a claim read that waits on a slow API server can reach.
_REQUEST_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 45.0)

build_info: Final = Gauge(
    "gpu_dra_build_info", "The driver's version; always 1.", ["version"], registry=REGISTRY
)
build_info.labels(version=__version__).set(1)

request_duration: Final = Histogram(
    "gpu_dra_request_duration_seconds",
    "NodePrepareResources / NodeUnprepareResources calls from the kubelet, by operation and "
    "result (error: at least one claim of the call was refused).",
    ["operation", "result"],
    buckets=_REQUEST_BUCKETS,
    registry=REGISTRY,
)
requests_inflight: Final = Gauge(
    "gpu_dra_requests_inflight", "Kubelet calls being answered now, by operation.", ["operation"],
    registry=REGISTRY,
)
claims: Final = Counter(
    "gpu_dra_claims",
    "Claims answered, by operation (prepare|unprepare) and result (success|error).",
    ["operation", "result"],
    registry=REGISTRY,
)
prepared_claims: Final = Gauge(
    "gpu_dra_prepared_claims", "Claims prepared on this node (the checkpoint).", registry=REGISTRY
)
devices_published: Final = Gauge(
    "gpu_dra_published_devices", "Devices in the ResourceSlices this process publishes, by pool.", ["pool"],
    registry=REGISTRY,
)
slice_writes: Final = Counter(
    "gpu_dra_resourceslice_writes",
    "ResourceSlice writes, by operation (create|update|delete).",
    ["operation"],
    registry=REGISTRY,
)
features_off: Final = Gauge(
    "gpu_dra_features_off",
    "1 for each feature asked for (--memory-shares, --memory-shares-only, --consumable-shares, "
    "--dynamic-mig, device health taints) that this process publishes without because the API server "
    "drops its fields; the log and a Warning Event on the Node say why and which feature gate to turn on.",
    ["feature"],
    registry=REGISTRY,
)
foreign_allocations: Final = Counter(
    "gpu_dra_foreign_allocations",
    "Prepares refused because the claim's allocation was made for another claim of the same name "
    "(kube-scheduler wrote it onto a re-created claim); each needs its pods deleted to be allocated anew.",
    registry=REGISTRY,
)
slice_conflicts: Final = Counter(
    "gpu_dra_resourceslice_conflicts",
    "ResourceSlice writes refused with 409 Conflict (someone else changed the slice first).",
    registry=REGISTRY,
)
api_errors: Final = Counter(
    "gpu_dra_api_errors",
    "Failed Kubernetes API calls, by component (publisher|claims|claim-status) and HTTP status "
    "(or 'network' when no answer came).",
    ["component", "code"],
    registry=REGISTRY,
)
health_events: Final = Counter(
    "gpu_dra_health_events",
    "Device health events seen, by kind (e.g. xid, ecc, unhealthy, recovered).",
    ["kind"],
    registry=REGISTRY,
)
health_monitor_waits: Final = Counter(
    "gpu_dra_health_monitor_waits",
    "NVML event waits of the health monitor, by how they ended (timeout|event|ignored|lost|error): "
    "about one timeout per check (every 0.4 s) on a quiet node; a stalled count is a stuck monitor.",
    ["result"],
    registry=REGISTRY,
)
device_claim_info: Final = Gauge(
    "gpu_dra_device_claim_info",
    "1 for each device prepared on this node and each pod its claim is reserved for; removed at "
    "Unprepare. Join with DCGM's per-GPU series on uuid = UUID (docs/observability.md).",
    ["device", "uuid", "pci_bus_id", "claim_namespace", "claim_name", "claim_uid", "pod_namespace",
     "pod_name"],
    registry=REGISTRY,
)


CLAIM_IDENTITY: Final = "gpu_dra_device_claim_info"


class _Served(Collector):
    """REGISTRY as the metrics port serves it: without the claim-identity series unless asked."""

    claim_identity = False

    def collect(self) -> Iterable[Metric]:
        for family in REGISTRY.collect():
            if self.claim_identity or family.name != CLAIM_IDENTITY:
                yield family


SERVED: Final = _Served()


def serve_claim_identity(on: bool) -> None:
    """Serve `gpu_dra_device_claim_info` (claim namespace, name, UID and pod) on the port."""
    SERVED.claim_identity = on


def api_error(component: str, error: BaseException) -> None:
    """Count one failed API call; `error` an `ApiException` (its status) or a network error."""
    status = getattr(error, "status", None)
    api_errors.labels(component=component, code=str(status) if isinstance(status, int) else "network").inc()


_children: dict[tuple[object, tuple[str, ...]], Any] = {}


def _child(metric: Counter | Gauge | Histogram, *labels: str) -> Any:
    """`metric.labels(*labels)`, looked up once: every kubelet call counts, and the client
    library's lookup takes a lock and builds its key each time."""
    key = (metric, labels)
    found = _children.get(key)
    if found is None:
        found = _children[key] = metric.labels(*labels)
    return found


@contextmanager
def timed_request(operation: Operation) -> Iterator[list[str]]:
    """Time one kubelet call: yields a list; append a claim's result ("success" or "error")
    for each claim answered. The call counts as an error if any of its claims failed."""
    results: list[str] = []
    inflight = _child(requests_inflight, operation)
    inflight.inc()
    start = time.perf_counter()
    try:
        yield results
    except BaseException:
        results.append("error")
        raise
    finally:
        inflight.dec()
        for result in set(results):
            _child(claims, operation, result).inc(results.count(result))
        outcome = "error" if "error" in results else "success"
        _child(request_duration, operation, outcome).observe(time.perf_counter() - start)
