"""One device of a prepared claim: what Prepare answered the kubelet, and what the checkpoint keeps;
and one claim's answer (`ClaimResult`), which carries those devices or the error.

The same record travels from the prepare transaction into the checkpoint and back out to
the gRPC answer, so there is nothing to convert and nothing to drift apart. It holds no
hardware facts (those come from discovery at start) and does no I/O. The one exception is
`MigRecord`: a MIG instance the plugin creates for a claim exists only because of it, so
the checkpoint must say where it is (and, once made, its ids) to destroy or adopt it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dra_driver.jsontypes import JSON


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None
    # granted with adminAccess: such a device may be in several claims at once
    admin_access: bool = False


@dataclass(frozen=True)
class MigRecord:
    """A dynamic MIG instance of a claim: first the intent (where it will be made), written
    before it is created; then, once made, its ids and MIG UUID."""

    device: str  # the allocated placement device's name
    parent_uuid: str
    profile_id: int  # GPU-instance profile id
    start: int  # first memory slice
    gpu_instance_id: int | None = None  # None: an intent; the create may or may not have happened
    compute_instance_id: int | None = None
    uuid: str | None = None

    @property
    def created(self) -> bool:
        return self.gpu_instance_id is not None and self.compute_instance_id is not None


@dataclass(frozen=True)
class ClaimResult:
    """One claim's answer to the kubelet: its devices, or an error the user can act on."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str | None = None
    # the claim as this Prepare read it (the claim status write reuses it: no second GET);
    # None where no read was needed (prepared already) and in every Unprepare
    claim: JSON | None = field(default=None, compare=False, repr=False)
