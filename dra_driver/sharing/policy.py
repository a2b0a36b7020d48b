"""The one seam between a prepared claim and GPU sharing: plan it, apply it, release it.

The prepare transaction asks this module three things and nothing else: what a claim's
configuration asks for (`plan`, pure: it refuses a bad configuration with a message the
user can act on), what that adds to the claim's CDI devices (`edits`, pure), and to set
it up or tear it down on the node (`apply`, `release`, blocking I/O). A plan is an MPS
daemon per claim (`dra_driver.sharing.mps`): for a claim whose config asks for MPS, and
for every claim holding a memory share (`dra_driver.sharing.shares`) or a consumable
share of a whole GPU that asked for part of its memory (`dra_driver.sharing.consumable`), whose daemon
enforces the share's consumed memory as its pinned-memory limit. One claim holds at most
one share of a GPU, so two shares of one GPU are two claims with two daemons and two
independent limits, and Unprepare of one stops only its own. The transaction never
learns how sharing works.

It must not read or write the checkpoint or the CDI spec files: the transaction owns both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from dra_driver.cdi.spec import ContainerEdits
from dra_driver.devices import NodeDevice
from dra_driver.sharing.config import (
    ConfigError,
    GpuConfig,
    MpsConfig,
    claim_config_entries,
    device_configs,
    device_requests,
)
from dra_driver.sharing.consumable import MIB, limited_shares, shared_whole_gpus
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.mps.errors import MpsError
from dra_driver.sharing.mps.settings import MpsSettings, settings_for_claim
from dra_driver.sharing.nvidia_config import parse_claim_config, per_device
from dra_driver.sharing.shares import Share, allocated_shares, derived_thread_percentage

SharingPlan = MpsSettings  # what a claim's sharing needs on the node; None: nothing to share
SharingError = MpsError  # setting up or tearing down sharing failed on the node

__all__ = ["ConfigError", "Sharing", "SharingError", "SharingPlan"]


class Sharing:
    """Sharing for the claims of one driver on one node (its pool)."""

    def __init__(self, driver: str, pool: str, mps: MpsControl) -> None:
        self.driver = driver
        self.pool = pool
        self.mps = mps

    # -- pure --------------------------------------------------------------------------

    def plan(
        self,
        claim_uid: str,
        claim: Mapping[str, Any],
        devices: Sequence[NodeDevice],
        slices: frozenset[str] = frozenset(),
    ) -> SharingPlan | None:
        """What `claim` asks for on `devices` (each once; `slices`: the names of those that
        are dynamic MIG slices); None if it shares nothing.
        Raises ConfigError, whose message says what to fix in the claim or class."""
        configs = per_device(
            device_configs(claim, self.driver, self.pool, parse_claim_config), devices, slices
        )
        views = allocated_shares(claim, self.driver, self.pool, devices)
        shares = {**views, **limited_shares(claim, self.driver, self.pool, devices)}
        mps = [d for d in devices if d.name in shares or configs[d.name].uses_mps]
        if not mps:
            return None
        requests = device_requests(claim, self.driver, self.pool)
        mixed = {r for d in mps for r in requests.get(d.name, ())} & {
            r for d in devices if d not in mps for r in requests.get(d.name, ())
        }
        if mixed:
            # A container gets the devices of the requests it names; an MPS client sees only
            # the daemon's GPUs, so one request cannot hold both kinds.
            raise ConfigError(
                "MPS must be configured for all devices of a request or for none (an MPS client sees "
                f"only the daemon's GPUs; a memory share is always served by MPS); request "
                f"{', '.join(sorted(mixed))} has MPS for {', '.join(d.name for d in mps)} only: put the "
                "other devices in a request of their own, or configure MPS for them"
            )
        # A memory share's compute follows its memory; a consumable share keeps the whole GPU's,
        # time-sliced, as NVIDIA's driver gives it (only its memory is limited here).
        percentage = _share_thread_percentage(views, configs)
        entries = []
        for d in mps:
            config = configs[d.name]
            if d.name in shares:
                share = shares[d.name]
                configured = claim_config_entries(claim, self.driver, parse_claim_config)
                named = any(e.applies_to(share.request) for e in configured)
                entries.append((d.uuid, _share_mps(share, config, named, percentage)))
            else:
                base = config.sharing.mps or MpsConfig()
                limit = _limit_within(d, base.default_pinned_device_memory_limit)
                entries.append((d.uuid, replace(base, default_active_thread_percentage=percentage,
                                                default_pinned_device_memory_limit=limit)))
        settings = settings_for_claim(claim_uid, entries)
        shared = shared_whole_gpus(claim, self.driver, self.pool)
        if not shares and all(d.mig is None and d.name not in shared for d in mps):
            # the claim owns these whole GPUs: no other claim's process belongs on them
            settings = replace(settings, exclusive_gpus=tuple(d.uuid for d in mps))
        return settings

    def edits(self, plan: SharingPlan | None, devices: Sequence[NodeDevice]) -> dict[str, ContainerEdits]:
        """Extra CDI container edits by device name."""
        if plan is None:
            return {}
        served = {d.uuid for d in plan.devices}
        edits = self.mps.container_edits(plan)
        return {d.name: edits for d in devices if d.uuid in served}

    # -- node I/O (blocking) -----------------------------------------------------------

    def apply(self, plan: SharingPlan | None) -> None:
        if plan is not None:
            self.mps.start(plan)

    def release(self, claim_uid: str) -> None:
        """Tear down whatever sharing the claim had; idempotent."""
        self.mps.stop(claim_uid)

    def has_state(self, claim_uid: str) -> bool:
        """Whether the claim has sharing state here (so releasing it may wait for a daemon)."""
        return self.mps.has_state(claim_uid)

    def saved_plan(self, claim_uid: str) -> SharingPlan | None:
        """The plan a claim's sharing was applied with (it survives a plugin restart)."""
        return self.mps.saved_settings(claim_uid)

    def claims_with_state(self) -> frozenset[str]:
        """Claims that have sharing state on this node (running or not)."""
        return self.mps.claim_uids()

    def ensure_running(self, claim_uid: str) -> None:
        """Restart a prepared claim's sharing that died with its processes (e.g. a reboot of
        the daemon); raises SharingError if it cannot."""
        plan = self.saved_plan(claim_uid)
        if plan is not None and not self.mps.is_running(claim_uid):
            self.mps.start(plan)


def _limit_within(device: NodeDevice, limit: int | None) -> int | None:
    """The pinned-memory limit the device's daemon gets: a limit above the device's own memory
    holds it to all of its memory, which is what such a limit means (NVIDIA's driver runs even
    1Ei as no limit), so it is the device's memory in whole MiB rather than a refusal that
    would leave the claim holding the GPU without running (issue 49: admitted, then stuck)."""
    memory = device.mig.memory_bytes if device.mig is not None else device.gpu.memory_bytes
    if limit is None or limit <= memory:
        return limit
    return memory // MIB * MIB


def _share_mps(share: Share, config: GpuConfig, named: bool, percentage: int | None) -> MpsConfig:
    """The MPS limits of one share: its consumed memory (or less, if the config asks for
    less) and the claim's thread percentage. `named`: a config entry applies to the share."""
    if named and not config.uses_mps:
        raise ConfigError(
            f"{share.device} is a memory share, which is always served by MPS (that is what holds it to "
            f"its memory); sharing.strategy {config.sharing.strategy.value} cannot apply to it: set strategy "
            "MPS, or remove this config from the request, or ask for a whole GPU (class gpu.<driver>, "
            "without capacity.requests.memory) to time-slice"
        )
    limit = share.memory
    configured = config.sharing.mps.default_pinned_device_memory_limit if config.sharing.mps else None
    if configured is not None:
        if configured > share.memory:
            raise ConfigError(
                f"mps.defaultPinnedDeviceMemoryLimit ({configured} bytes) is more than the share of "
                f"{share.device} ({share.memory} bytes): a share is limited to the memory it was "
                "allocated; remove defaultPinnedDeviceMemoryLimit (the share's size is its limit) or ask "
                "for more memory in capacity.requests.memory"
            )
        limit = configured
    return MpsConfig(default_active_thread_percentage=percentage, default_pinned_device_memory_limit=limit)


def _share_thread_percentage(shares: Mapping[str, Share], configs: Mapping[str, GpuConfig]) -> int | None:
    """The claim's daemon-wide active-thread percentage: the config's if it sets one, else
    derived from the largest share's fraction of its GPU; None without shares."""
    configured = {
        c.sharing.mps.default_active_thread_percentage
        for c in configs.values()
        if c.sharing.mps is not None and c.sharing.mps.default_active_thread_percentage is not None
    }
    if len(configured) == 1:
        return configured.pop()
    if len(configured) > 1:
        raise ConfigError(
            "all MPS devices of one claim share one daemon and must have the same "
            f"mps.defaultActiveThreadPercentage (got {', '.join(map(str, sorted(configured)))}): give every "
            "MPS config of the claim and of its DeviceClasses the same one, or set it in one config only"
        )
    if not shares:
        return None
    return max(derived_thread_percentage(s.memory, s.gpu_memory) for s in shares.values())
