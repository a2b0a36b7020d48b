"""NVIDIA's consumable shares (`--consumable-shares`): the whole GPUs of the standard class
(`gpu-<i>`, type "gpu") given out to several claims at once, as NVIDIA's v0.5.0 driver
publishes them, and what such an allocation asks of the node.

The modes, as NVIDIA names them (controller.consumable publishes them):

    memory      memory policy {default: all of it, min 1Mi, step 1Mi}: a claim without
                capacity.requests.memory gets the GPU to itself, one with 4Gi shares it
    unlimited   memory policy {default 0, min 0, step 1Mi}: claims share without asking
    <N>         as unlimited, plus capacity `shares: N` {default 1, min 1, max N}

On the node an allocation of a whole GPU with a `shareID` is a shared GPU. What it
consumed of `memory` decides what the claim gets, whatever mode published it (so a plugin
restarted with another mode still prepares what was allocated): between 0 and the whole
GPU, an MPS daemon of its own that holds it to that much pinned memory (a `Share`, as a
memory share of `dra_driver.sharing.shares`); 0 or all of it, the GPU time-sliced with its
other claims, nothing started (NVIDIA's driver time-slices every one of them).

Pure: parsing and reading allocations. Nothing here publishes, starts or reads files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from dra_driver.devices import NodeDevice
from dra_driver.sharing.config import ConfigError
from dra_driver.sharing.shares import Share, consumed_memory, is_share_view, shareable

MIB: Final = 2**20
SHARES: Final = "shares"  # the capacity of the integer mode
MAX_SHARES: Final = 1024  # more claims than any GPU runs processes for


@dataclass(frozen=True)
class ConsumableShares:
    """The mode of `--consumable-shares`; `count` only for the integer mode."""

    mode: Literal["memory", "unlimited", "count"]
    count: int = 0

    @staticmethod
    def parse(value: str) -> ConsumableShares | None:
        """`disabled` (or empty) -> None; `memory`, `unlimited` or a whole number 1..MAX_SHARES.
        Raises ValueError saying what to write."""
        text = value.strip()
        if text in ("", "disabled"):
            return None
        if text in ("memory", "unlimited"):
            return ConsumableShares(text)  # type: ignore[arg-type]
        if text.isdigit() and 1 <= int(text) <= MAX_SHARES:
            return ConsumableShares("count", int(text))
        raise ValueError(
            f"--consumable-shares {value!r}: write disabled, memory, unlimited or a whole number of "
            f"shares per GPU from 1 to {MAX_SHARES} (NVIDIA's --consumable-shares values)"
        )

    def __str__(self) -> str:
        return str(self.count) if self.mode == "count" else self.mode


def whole_memory(device: NodeDevice) -> int:
    """The GPU's memory as the `memory` capacity publishes it: rounded down to whole MiB (the
    policy's step, which the API wants max and default to be multiples of)."""
    return device.gpu.memory_bytes // MIB * MIB


def consumable(device: NodeDevice) -> bool:
    """A device that `--consumable-shares` publishes for several claims: a whole GPU."""
    return shareable(device) and not is_share_view(device.name)


def limited_shares(
    claim: Mapping[str, Any], driver: str, pool: str, devices: Sequence[NodeDevice]
) -> dict[str, Share]:
    """The claim's consumable-shared whole GPUs among `devices` that an MPS daemon must hold to
    their consumed memory, by device name. Raises ConfigError for an allocation the scheduler
    never writes: a consumed memory that is not a whole number of bytes."""
    by_name = {d.name: d for d in devices if consumable(d)}
    limited: dict[str, Share] = {}
    for result in _results(claim, driver, pool):
        device = by_name.get(str(result.get("device", "")))
        share_id = result.get("shareID")
        if device is None or not isinstance(share_id, str) or not share_id:
            continue
        memory = _consumed_memory(result, device.name)
        if memory is None or memory == 0 or memory >= whole_memory(device):
            continue  # time-sliced with the GPU's other claims, as NVIDIA's driver does
        if device.name in limited:
            raise ConfigError(
                f"the claim holds two shares of {device.name}: one container connects to one MPS daemon, "
                "so ask for one share with the sum of the memory (one request), or keep the requests on "
                "different GPUs with a distinctAttribute constraint on uuid"
            )
        limited[device.name] = Share(device.name, str(result.get("request", "")), share_id, memory,
                                     device.gpu.memory_bytes)
    return limited


def shared_whole_gpus(claim: Mapping[str, Any], driver: str, pool: str) -> frozenset[str]:
    """The whole GPUs (by device name) the claim holds with a shareID: other claims may use them."""
    return frozenset(str(r.get("device", "")) for r in _results(claim, driver, pool) if r.get("shareID"))


def _results(claim: Mapping[str, Any], driver: str, pool: str) -> list[Mapping[str, Any]]:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return [r for r in results
            if isinstance(r, Mapping) and r.get("driver") == driver and r.get("pool") == pool]


def _consumed_memory(result: Mapping[str, Any], device: str) -> int | None:
    """Bytes of `memory` the scheduler charged; None where it charged none (no entry)."""
    raw, value = consumed_memory(result)
    if raw is None:
        return None
    if value is None or value < 0:
        raise ConfigError(
            f"{device} was allocated with consumedCapacity.memory {raw!r}, which is not a whole number of "
            "bytes: the scheduler never writes that; delete the claim and let the scheduler allocate it"
        )
    return value
