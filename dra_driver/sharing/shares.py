"""Memory shares of a whole GPU: how they are published, and what an allocated share is.

With `--memory-shares` every whole GPU is published twice, as two views of one device:

    gpu-0         the whole GPU, exclusive (type "gpu"), as without shares
    gpu-0-share   the same GPU for memory shares (type "gpu-share"): allowMultipleAllocations,
                  one capacity `memory` with the request policy below

Both consume the counter `memory` (the GPU's whole framebuffer) of the counter set
`gpu-0-memory`. The scheduler charges a multi-allocatable device's counters once, on its
first allocation (KEP-5075 with KEP-4815), so the first share takes the counter and every
further share only needs free `memory` capacity: a whole-GPU claim then finds no counter
left, and while a whole-GPU claim holds the counter no share can start. When the last
share is gone the counter is free again.
With `--memory-shares-only` a whole GPU is published as its share view alone, without
counters (controller.capacity); everything below is the same.

Request policy of `memory` (docs/sharing.md says why): `validRange {min: 1Gi, step: 1Gi,
max: the GPU's memory rounded down to whole Gi}`, `default: 8Gi` (or max, if smaller).
The scheduler rounds a request up to the next whole Gi; the share's MPS limit is exactly
what it consumed.

An allocated share (`Share`) is read from the claim's allocation result: the device, its
`shareID` and `consumedCapacity.memory`. `allocated_shares` checks what a hand-written or
stale allocation could get wrong and says what to write instead. Pure functions and
frozen dataclasses: nothing here does I/O or starts anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from dra_driver.devices import NodeDevice
from dra_driver.sharing.config import ConfigError, quantity_value

GI: Final = 2**30
SHARE_TYPE: Final = "gpu-share"  # the `type` attribute of a share view
# A share view's `isolation` attribute: its memory limit holds only for processes that use
# the share's MPS daemon; one that steps around MPS gets the whole GPU (docs/sharing.md has
# the measurement). A cluster policy can select on it, e.g. to keep shares from tenants
# that must not trust each other.
ISOLATION_ATTRIBUTE: Final = "isolation"
COOPERATIVE: Final = "cooperative"
# What `dra-driver inventory` tells whoever chooses between shares and whole GPUs.
ISOLATION_NOTE: Final = (
    "Memory shares (--memory-shares) of these GPUs: a share's memory limit holds for processes that use\n"
    "its MPS daemon; isolation is cooperative (attribute isolation=cooperative): a process that steps\n"
    "around MPS gets the whole GPU (on an H200, 20 GiB on a 10Gi share). Tenants that must be isolated\n"
    "need MIG instances or whole GPUs. docs/sharing.md"
)
SHARE_SUFFIX: Final = "-share"
COUNTER_SET_SUFFIX: Final = "-memory"
MEMORY: Final = "memory"  # the capacity and the counter
MIN_SHARE: Final = 1 * GI
SHARE_STEP: Final = 1 * GI
DEFAULT_SHARE: Final = 8 * GI


# --------------------------------------------------------------------------- names


def share_view_name(whole_gpu: str) -> str:
    """`gpu-0` -> `gpu-0-share`: the device that memory shares of that GPU are allocated from."""
    return f"{whole_gpu}{SHARE_SUFFIX}"


def counter_set_name(whole_gpu: str) -> str:
    """`gpu-0` -> `gpu-0-memory`: the counter set both views of the GPU consume."""
    return f"{whole_gpu}{COUNTER_SET_SUFFIX}"


def shareable(device: NodeDevice) -> bool:
    """Whole GPUs only: a GPU in MIG mode is published as its MIG instances."""
    return device.mig is None and not device.gpu.mig_enabled


def share_views(devices: Mapping[str, NodeDevice]) -> dict[str, NodeDevice]:
    """The share view of every whole GPU, by name (same GPU, the share view's name)."""
    return {
        share_view_name(name): NodeDevice(share_view_name(name), d.gpu)
        for name, d in devices.items()
        if shareable(d)
    }


def is_share_view(name: str) -> bool:
    return name.endswith(SHARE_SUFFIX)


# --------------------------------------------------------------------------- the policy


@dataclass(frozen=True)
class MemoryPolicy:
    """The `requestPolicy` of a share view's `memory` capacity, in bytes."""

    minimum: int
    step: int
    maximum: int
    default: int

    def to_json(self, quantity: Callable[[int], str]) -> dict[str, Any]:
        """The API's `requestPolicy` object; `quantity` formats a byte count."""
        bounds = {"min": self.minimum, "max": self.maximum, "step": self.step}
        return {
            "default": quantity(self.default),
            "validRange": {k: quantity(v) for k, v in bounds.items()},
        }

    def rounded(self, request: int) -> int:
        """What the scheduler makes of a request: rounded up onto the range (may exceed max)."""
        if request <= self.minimum:
            return self.minimum
        return self.minimum + math.ceil((request - self.minimum) / self.step) * self.step

    def is_valid(self, amount: int) -> bool:
        return self.minimum <= amount <= self.maximum and (amount - self.minimum) % self.step == 0


def memory_policy(total_bytes: int) -> MemoryPolicy | None:
    """The policy for a GPU of `total_bytes`; None if the GPU is too small to share (< 2Gi:
    the API wants min + step within the capacity)."""
    maximum = total_bytes // SHARE_STEP * SHARE_STEP
    if maximum < MIN_SHARE + SHARE_STEP:
        return None
    return MemoryPolicy(MIN_SHARE, SHARE_STEP, maximum, min(DEFAULT_SHARE, maximum))


def derived_thread_percentage(consumed: int, total: int) -> int:
    """The MPS active-thread percentage a share gets unless its config says otherwise: its
    fraction of the GPU's memory, rounded up (40Gi of 140Gi -> 29)."""
    return max(1, min(100, math.ceil(100 * consumed / total)))


# --------------------------------------------------------------------------- allocated shares


@dataclass(frozen=True)
class Share:
    """One allocated memory share of a GPU."""

    device: str  # the share view, e.g. gpu-0-share
    request: str  # the request (or request/subrequest) it was allocated for
    share_id: str
    memory: int  # bytes the scheduler charged: the share's MPS limit
    gpu_memory: int  # the whole GPU's


def _gib(n: int) -> str:
    return f"{n / GI:g}Gi"


def consumed_memory(result: Mapping[str, Any]) -> tuple[object, int | None]:
    """An allocation result's `consumedCapacity.memory`: as written, and in whole bytes (None
    where it is missing or not a whole number of bytes)."""
    consumed = result.get("consumedCapacity") or {}
    raw = consumed.get(MEMORY) if isinstance(consumed, Mapping) else None
    value = quantity_value(raw) if isinstance(raw, str) else None
    return raw, None if value is None or value != value.to_integral_value() else int(value)


def _consumed_memory(result: Mapping[str, Any], device: str) -> int:
    raw, value = consumed_memory(result)
    if value is None:
        raise ConfigError(
            f"share of {device} has no consumedCapacity.memory in its allocation (got {raw!r}): "
            "the scheduler must run with DRAConsumableCapacity (beta, on by default since 1.36); "
            "ask for the whole GPU instead (class gpu.<driver>) if the feature is off"
        )
    return value


def allocated_shares(
    claim: Mapping[str, Any], driver: str, pool: str, devices: Sequence[NodeDevice]
) -> dict[str, Share]:
    """The shares among `devices` (the claim's devices of this pool), by share-view name.

    Raises ConfigError for what the scheduler never writes but a hand-written allocation
    can: no shareID or consumed memory, an amount off the policy or over the GPU, two
    shares of one GPU in one claim (one MPS client connects to one daemon)."""
    views = {d.name: d for d in devices if is_share_view(d.name)}
    if not views:
        return {}
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    shares: dict[str, Share] = {}
    for result in results:
        if not isinstance(result, Mapping) or result.get("driver") != driver or result.get("pool") != pool:
            continue
        name = str(result.get("device", ""))
        view = views.get(name)
        if view is None:
            continue
        if name in shares:
            raise ConfigError(
                f"the claim holds two shares of {name}: one container connects to one MPS daemon, so "
                "ask for one share with the sum of the memory (one request), or add "
                f'constraints: [{{distinctAttribute: "{driver}/uuid"}}] to keep the requests on '
                "different GPUs"
            )
        share_id = result.get("shareID")
        if not isinstance(share_id, str) or not share_id:
            raise ConfigError(
                f"{name} was allocated without a shareID: a memory share needs the scheduler's "
                "DRAConsumableCapacity feature; ask for the whole GPU instead if it is off"
            )
        memory = _consumed_memory(result, name)
        policy = memory_policy(view.gpu.memory_bytes)
        if policy is None:
            raise ConfigError(f"{name}: GPU {view.gpu.index} has too little memory to be shared")
        if memory > policy.maximum:
            raise ConfigError(
                f"share of {name} asks for {_gib(memory)}, more than the GPU has ({_gib(policy.maximum)} in "
                f"whole Gi): ask for at most {_gib(policy.maximum)}, or for the whole GPU"
            )
        if not policy.is_valid(memory):
            raise ConfigError(
                f"share of {name} has {memory} bytes of memory, which is not a whole number of Gi of "
                f"at least {_gib(policy.minimum)}: write capacity.requests.memory as whole Gi, e.g. "
                f"{_gib(policy.rounded(memory))}"
            )
        shares[name] = Share(name, str(result.get("request", "")), share_id, memory, view.gpu.memory_bytes)
    return shares
