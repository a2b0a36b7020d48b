"""Which optional ResourceSlice features the API server has, asked once at start.

`detect_list_attributes` sends a dry-run create (nothing is stored) and looks at what
comes back; `resolve_features` turns the `--list-attributes auto|on|off` choice into the
`SliceFeatures` that the pure slice builder takes.

It must NOT write anything to the server (dry run only), retry, or decide what a slice
contains: an unreachable server is the caller's error to handle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import structlog

from controller.plan import SLICES
from controller.slices import SliceFeatures
from dra_driver import kube
from dra_driver.kube import ApiClient, ApiException

log = structlog.get_logger(__name__)

ListAttributesMode = Literal["auto", "on", "off"]


async def detect_list_attributes(api: ApiClient, driver: str) -> bool:
    """Whether the server keeps list-type attributes (DRAListTypeAttributes), by a dry-run create.

    A server without the feature either rejects the field or silently drops it; both
    mean "publish the GA string forms only".
    """
    probe = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"probe-{driver}"},
        "spec": {
            "driver": driver,
            "allNodes": True,
            "pool": {"name": "probe", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "probe", "attributes": {"probe": {"strings": ["a", "b"]}}}],
        },
    }
    try:
        created = await kube.request(api, "POST", SLICES, body=probe, query={"dryRun": "All"})
    except ApiException as e:
        if e.status in (400, 422):
            return False
        raise
    attrs: Mapping[str, Any] = created["spec"]["devices"][0].get("attributes", {})
    return bool(attrs.get("probe", {}).get("strings"))


async def resolve_features(
    api: ApiClient, driver: str, list_attributes: ListAttributesMode
) -> SliceFeatures:
    if list_attributes == "auto":
        enabled = await detect_list_attributes(api, driver)
        log.info("detected list-type attribute support", enabled=enabled)
    else:
        enabled = list_attributes == "on"
    return SliceFeatures(list_attributes=enabled)
