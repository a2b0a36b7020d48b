"""NVIDIA's consumable shares in a node's ResourceSlices (`--consumable-shares`): each whole GPU
of the standard class published for several claims at once, with the capacities and request
policies NVIDIA's v0.5.0 driver gives it (`dra_driver.sharing.consumable` has the modes and
what the node does with an allocation).

`with_consumable_shares` takes the device entries `controller.slices` built and returns them
with every whole GPU `allowMultipleAllocations`, its `memory` rounded down to whole MiB with
the mode's request policy, and in the integer mode a `shares` capacity. `multiprocessors` is
left out of those GPUs: a capacity without a policy is consumed whole by a device's first
allocation, which would leave the GPU to one claim. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controller.attributes import MEMORY, MULTIPROCESSORS
from controller.quantities import binary_quantity, decimal_quantity
from dra_driver.devices import NodeDevice
from dra_driver.jsontypes import JSON
from dra_driver.sharing.consumable import MIB, SHARES, ConsumableShares, consumable, whole_memory


def _range(default: int, minimum: int, maximum: int, step: int,
           fmt: Callable[[int], str] = binary_quantity) -> JSON:
    # The API wants min + step within the capacity: a range with no room for a step has none
    # (NVIDIA's --consumable-shares=1 publishes one and its slices are refused).
    bounds = {"min": minimum, "max": maximum, **({"step": step} if minimum + step <= maximum else {})}
    return {"default": fmt(default), "validRange": {k: fmt(v) for k, v in bounds.items()}}


def capacity(device: NodeDevice, mode: ConsumableShares) -> JSON:
    """The capacity map of a consumable whole GPU, as NVIDIA's applyConsumableShares makes it."""
    total = whole_memory(device)
    default, minimum = (total, MIB) if mode.mode == "memory" else (0, 0)
    out: JSON = {MEMORY: {"value": binary_quantity(total),
                          "requestPolicy": _range(default, minimum, total, MIB)}}
    if mode.mode == "count":
        out[SHARES] = {"value": decimal_quantity(mode.count),
                       "requestPolicy": _range(1, 1, mode.count, 1, decimal_quantity)}
    return out


def with_consumable_shares(
    devices: Sequence[NodeDevice], entries: Sequence[JSON], mode: ConsumableShares
) -> list[JSON]:
    """The entries with every whole GPU made consumable; other devices as they were."""
    out: list[JSON] = []
    for device, entry in zip(devices, entries, strict=True):
        if not consumable(device) or whole_memory(device) < 2 * MIB:
            out.append(entry)
            continue
        kept = {k: v for k, v in entry.get("capacity", {}).items() if k not in (MEMORY, MULTIPROCESSORS)}
        shared = {"capacity": {**kept, **capacity(device, mode)}, "allowMultipleAllocations": True}
        out.append({**entry, **shared})
    return out
