"""What Prepare hands back to the kubelet for one device: the wire-neutral result record."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None
