"""Listing API objects page by page for the read-only commands (`status`, `explain`).

It must NOT write, cache or interpret what it lists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

from dra_driver import kube
from dra_driver.jsontypes import JSON

RESOURCE_API: Final = "/apis/resource.k8s.io/v1"
PAGE: Final = 500


async def list_all(
    api: kube.ApiClient, path: str, what: str, query: Mapping[str, str], progress: Callable[[str], None]
) -> list[JSON]:
    items, _ = await kube.list_all(
        api, path, query, progress=lambda n: progress(f"reading {what}: {n} so far"), page=PAGE
    )
    return items
