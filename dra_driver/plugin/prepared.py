"""One device of a prepared claim: what Prepare answered the kubelet, and what the checkpoint keeps.

The same record travels from the prepare transaction into the checkpoint and back out to
the gRPC answer, so there is nothing to convert and nothing to drift apart. It holds no
hardware facts (those come from discovery at start) and does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None
    # granted with adminAccess: such a device may be in several claims at once
    admin_access: bool = False
