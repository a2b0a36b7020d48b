"""The one seam between a prepared claim and GPU sharing: plan it, apply it, release it.

The prepare transaction asks this module three things and nothing else: what a claim's
configuration asks for (`plan`, pure: it refuses a bad configuration with a message the
user can act on), what that adds to the claim's CDI devices (`edits`, pure), and to set
it up or tear it down on the node (`apply`, `release`, blocking I/O). Today a plan is an
MPS daemon per claim (`dra_driver.sharing.mps`); time-slicing and memory shares join
here, so the transaction never learns how sharing works.

It must not read or write the checkpoint or the CDI spec files: the transaction owns both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dra_driver import cdi
from dra_driver.devices import NodeDevice
from dra_driver.sharing.config import ConfigError, device_configs
from dra_driver.sharing.mps import MpsControl, MpsError, MpsSettings, settings_for_claim

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
        self, claim_uid: str, claim: Mapping[str, Any], devices: Sequence[NodeDevice]
    ) -> SharingPlan | None:
        """What `claim` asks for on `devices` (each once); None if it shares nothing.
        Raises ConfigError, whose message says what to fix in the claim or class."""
        configs = device_configs(claim, self.driver, self.pool)
        mps = [d for d in devices if configs[d.name].uses_mps]
        if not mps:
            return None
        if len(mps) != len(devices):
            raise ConfigError(
                "MPS must be configured for all devices of a claim or for none (an MPS client sees "
                f"only the daemon's GPUs); MPS is set for {', '.join(d.name for d in mps)} only"
            )
        return settings_for_claim(
            claim_uid, [(d.uuid, mps_config) for d in mps if (mps_config := configs[d.name].sharing.mps)]
        )

    def edits(self, plan: SharingPlan | None, devices: Sequence[NodeDevice]) -> dict[str, cdi.ContainerEdits]:
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
