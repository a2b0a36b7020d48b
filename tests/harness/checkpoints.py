"""Checkpoint edits for tests that set up a state on disk (a crash after `started`, say).

The plugin changes its checkpoint only inside its locked sections; tests build the states
those sections leave behind from the checkpoint module's own entry constructors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.prepared import PreparedDevice


def with_started(
    cp: ckpt.Checkpoint,
    namespace: str,
    name: str,
    uid: str,
    devices: Sequence[PreparedDevice],
    *,
    now: datetime | None = None,
) -> ckpt.Checkpoint:
    """Claim `uid` recorded as being prepared with `devices` (replacing an earlier entry)."""
    entry = ckpt.started_entry(namespace, name, uid, devices, now=now)
    return replace(cp, claims={**cp.claims, uid: entry})


def with_completed(
    cp: ckpt.Checkpoint,
    uid: str,
    *,
    now: datetime | None = None,
    devices: Sequence[PreparedDevice] | None = None,
) -> ckpt.Checkpoint:
    """The started claim `uid` recorded as prepared."""
    entry = ckpt.completed_entry(cp.claims[uid], now=now, devices=devices)
    return replace(cp, claims={**cp.claims, uid: entry})


def without(cp: ckpt.Checkpoint, uid: str) -> ckpt.Checkpoint:
    return replace(cp, claims={k: v for k, v in cp.claims.items() if k != uid})


def back_to_started(cp: ckpt.Checkpoint, uid: str) -> ckpt.Checkpoint:
    """Claim `uid`'s entry as a crash between its `started` and `completed` leaves it."""
    entry = cp.claims[uid]
    return with_started(without(cp, uid), entry.namespace, entry.name, entry.uid, entry.devices)
