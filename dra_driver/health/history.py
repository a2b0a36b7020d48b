"""The health history file: what the running plugin knows about each device, for `dra-driver inventory`.

The plugin rewrites `<data dir>/health.json` (atomically, at most every `WRITE_EVERY`
seconds and only after a change) with each device's health, taints, event counts and
last events; `dra-driver inventory` reads it back and prints it beside the hardware.
`document` and `render` are pure; `keep_file` and `read` are the I/O.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import structlog

from dra_driver.atomic import write_file_atomic
from dra_driver.health.keeper import HealthKeeper
from dra_driver.jsontypes import JSON

log = structlog.get_logger(__name__)

FILE_NAME: Final = "health.json"
WRITE_EVERY: Final = 2.0


def _time(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def document(keeper: HealthKeeper, now: float) -> JSON:
    """The history document of `keeper` (stable keys; docs/health.md)."""
    facts = keeper.facts
    devices: dict[str, Any] = {}
    for name in sorted(keeper.states):
        state, view = keeper.states[name], keeper.views[name]
        devices[name] = {
            "gpu": keeper.devices[name].gpu.index,
            "healthy": view.healthy,
            "message": view.message,
            "taints": [
                {"key": t.key, "value": t.value, "effect": t.effect, "timeAdded": _time(t.time_added)}
                for t in view.taints
            ],
            "counts": dict(sorted(state.counts.items())),
            "recoveries": state.recoveries,
            "recent": [
                {"at": _time(r.at), "event": r.what, "severity": r.severity, "message": r.message,
                 "count": r.count}
                for r in state.recent
            ],
        }
    return {
        "updated": _time(now),
        "policy": {
            "maxEffect": keeper.policy.max_effect,
            "quietPeriodSeconds": keeper.policy.quiet_period,
            "xidOverrides": {str(x): s.title for x, s in sorted(keeper.policy.xid_overrides.items())},
        },
        "monitor": {
            "registered": {str(g): list(k) for g, k in sorted(facts.registered.items())},
            "notOffered": {str(g): list(k) for g, k in sorted(facts.unsupported.items())},
            "recoveryActionField": {str(g): v for g, v in sorted(facts.recovery_action_field.items())},
        },
        "eventsSeen": keeper.events_seen,
        "devices": devices,
    }


def render(doc: JSON) -> str:
    """The document as lines for people (the health part of `dra-driver inventory`)."""
    lines = [f"Device health (plugin's view at {doc.get('updated', '?')}, "
             f"{doc.get('eventsSeen', 0)} NVML events seen):"]
    for name, d in doc.get("devices", {}).items():
        status = "Healthy" if d.get("healthy") else f"Unhealthy: {d.get('message', '')}"
        counts = ", ".join(f"{k}={v}" for k, v in d.get("counts", {}).items()) or "no events"
        lines.append(f"  {name:<28} {status}  [{counts}; recoveries {d.get('recoveries', 0)}]")
        lines.extend(f"      taint {t['key']}={t['value']}:{t['effect']} since {t['timeAdded']}"
                     for t in d.get("taints", []))
        lines.extend(f"      {r['at']} {r['event']} x{r['count']} {r['severity']} {r['message']}".rstrip()
                     for r in d.get("recent", [])[-5:])
    registered = doc.get("monitor", {}).get("registered", {})
    if registered:
        lines.append("  NVML events registered per GPU: " + "; ".join(
            f"{g}: {', '.join(k) or 'none'}" for g, k in registered.items()))
    return "\n".join(lines)


def write(keeper: HealthKeeper, path: Path, now: float) -> None:
    write_file_atomic(path, json.dumps(document(keeper, now), indent=1).encode(), durable=False)


async def keep_file(keeper: HealthKeeper, path: Path, every: float = WRITE_EVERY) -> None:
    """Rewrite the history file after each change, at most once per `every` seconds."""
    written = -1
    while True:
        if keeper.history_version != written:
            written = keeper.history_version
            try:
                await asyncio.to_thread(write, keeper, path, keeper.clock())
            except OSError as err:
                log.warning("health history file not written", path=str(path), error=str(err))
        await asyncio.sleep(every)


def read(path: Path) -> JSON | None:
    """The history document at `path`; None when there is none. Raises ValueError for a broken file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{path} is not a health history document ({err}); the plugin rewrites it") from err
    if not isinstance(doc, dict):
        raise ValueError(f"{path} is not a health history document; the plugin rewrites it")
    return doc
