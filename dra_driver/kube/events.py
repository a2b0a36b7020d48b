"""A core/v1 Event about an object, as a component of this driver posts it (the body only).

Pure: the caller posts it (`kube.request`) and decides when; nothing here talks to the API server.
"""

from __future__ import annotations

from datetime import UTC, datetime

from dra_driver.jsontypes import JSON


def event_body(involved: JSON, reason: str, message: str, warning: bool, driver: str, node: str) -> JSON:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{involved['name']}.", "namespace": involved["namespace"]},
        "involvedObject": involved,
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": driver, "host": node},
        "reportingComponent": driver,
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
