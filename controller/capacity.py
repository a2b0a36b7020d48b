"""Memory shares in a node's ResourceSlices: the share view of each whole GPU and the
counter set that keeps whole-GPU claims and shares apart (`dra_driver.sharing.shares`
has the design and the names).

`with_memory_shares` takes the device entries `controller.slices` built and returns them
with, for every whole GPU, `consumesCounters` on the whole GPU, its share view right after
it, and the GPU's counter set. With `only` (`--memory-shares-only`) a whole GPU is published
as its share view alone, without counters: no whole-GPU claim can take it, and the scheduler
has no counters to check (kube-scheduler 1.37 checks a pool's counters by scanning every
allocated share of the cluster for each device, which costs share pods much of their
scheduling rate: docs/sharing.md has the figures). Pure: no I/O, no API calls;
the caller puts the counter sets in slices of their own (since 1.35 a slice holds devices or
counters, not both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from controller.attributes import LINKED_SET_ATTRIBUTES, TYPE
from controller.quantities import binary_quantity
from dra_driver.devices import NodeDevice
from dra_driver.jsontypes import JSON
from dra_driver.sharing.shares import (
    COOPERATIVE,
    ISOLATION_ATTRIBUTE,
    MEMORY,
    SHARE_TYPE,
    counter_set_name,
    memory_policy,
    share_view_name,
    shareable,
)

MAX_COUNTER_SETS_PER_SLICE: Final = 8  # resource.k8s.io/v1 since 1.35


def _consumes(device: NodeDevice) -> list[JSON]:
    """The whole framebuffer of the GPU's counter set: both views take all of it (a
    multi-allocatable device is charged once, on its first share)."""
    return [
        {
            "counterSet": counter_set_name(device.name),
            "counters": {MEMORY: {"value": binary_quantity(device.gpu.memory_bytes)}},
        }
    ]


def counter_set(device: NodeDevice) -> JSON:
    return {
        "name": counter_set_name(device.name),
        "counters": {MEMORY: {"value": binary_quantity(device.gpu.memory_bytes)}},
    }


def share_view(device: NodeDevice, whole: JSON, counters: bool = True) -> JSON | None:
    """The share view of the whole GPU `device` published as `whole`; None if too small.
    Without `counters` nothing else is published for the GPU, so nothing needs keeping apart."""
    policy = memory_policy(device.gpu.memory_bytes)
    if policy is None:
        return None
    # not the clique attributes: a share is not a whole GPU, and the linked claims' class has no
    # selector to tell them apart (controller.claim_shapes)
    attributes = {
        **{k: v for k, v in whole.get("attributes", {}).items() if k not in LINKED_SET_ATTRIBUTES},
        TYPE: {"string": SHARE_TYPE},
        ISOLATION_ATTRIBUTE: {"string": COOPERATIVE},
    }
    return {
        "name": share_view_name(device.name),
        "attributes": attributes,
        # memory only: any other capacity without a policy would be consumed whole by the first share
        "capacity": {
            MEMORY: {
                "value": binary_quantity(device.gpu.memory_bytes),
                "requestPolicy": policy.to_json(binary_quantity),
            }
        },
        "allowMultipleAllocations": True,
        **({"consumesCounters": _consumes(device)} if counters else {}),
    }


def with_memory_shares(
    devices: Sequence[NodeDevice], entries: Sequence[JSON], only: bool = False
) -> tuple[list[JSON], list[JSON]]:
    """The device entries with share views added, and the counter sets they consume; with
    `only`, each shareable GPU's share view in place of the whole GPU, and no counter sets."""
    out: list[JSON] = []
    counter_sets: list[JSON] = []
    for device, entry in zip(devices, entries, strict=True):
        view = share_view(device, entry, counters=not only) if shareable(device) else None
        if view is None:
            out.append(entry)
            continue
        if only:
            out.append(view)
            continue
        out.append({**entry, "consumesCounters": _consumes(device)})
        out.append(view)
        counter_sets.append(counter_set(device))
    return out, counter_sets
