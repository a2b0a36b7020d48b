"""Kubernetes Events for people: a device of a claim became unhealthy, or healthy again.

`ClaimEvents.follow(keeper)` compares each health snapshot with the one before; for each
device whose view changed it looks up the prepared claims holding that device
(`claims_using`, from the plugin's checkpoint) and posts a core/v1 Event on each claim and
on each pod the claim is reserved for (`kubectl describe pod` shows it). Events go out
only on transitions, so a storm posts at most one per claim per change. A failed post is
logged and dropped: the taint and the health stream carry the state; Events only tell.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import structlog

from dra_driver import kube
from dra_driver.health.effects import DeviceView
from dra_driver.health.keeper import HealthKeeper
from dra_driver.jsontypes import JSON
from dra_driver.kube.events import event_body

log = structlog.get_logger(__name__)

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"


@dataclass(frozen=True)
class ClaimUse:
    """A prepared claim and the devices of this node it holds."""

    namespace: str
    name: str
    uid: str
    devices: tuple[str, ...]


class ClaimEvents:
    def __init__(
        self,
        api: kube.ApiClient,
        driver: str,
        node: str,
        claims_using: Callable[[], Awaitable[Iterable[ClaimUse]]],
    ) -> None:
        self.api = api
        self.driver = driver
        self.node = node
        self.claims_using = claims_using
        self.posted = 0

    async def follow(self, keeper: HealthKeeper) -> None:
        previous: dict[str, DeviceView] | None = None
        async for snapshot in keeper.watch():
            if previous is not None:
                changed = {n: v for n, v in snapshot.views.items() if previous.get(n) != v}
                if changed:
                    await self._tell(changed)
            previous = dict(snapshot.views)

    async def _tell(self, changed: dict[str, DeviceView]) -> None:
        try:
            uses = list(await self.claims_using())
        except Exception as err:
            log.warning("cannot find the claims of changed devices; no Events posted", error=str(err))
            return
        posts = []
        for use in uses:
            for device in sorted(set(use.devices) & set(changed)):
                view = changed[device]
                if view.healthy:
                    reason, text = "DeviceHealthy", f"device {device} on node {self.node} is healthy again"
                else:
                    reason, text = "DeviceUnhealthy", f"device {device} on node {self.node}: {view.message}"
                    if view.taints:
                        text += "; tainted " + ", ".join(f"{t.key}={t.value}:{t.effect}" for t in view.taints)
                posts.append(self._post(use, reason, text, warning=not view.healthy))
        await asyncio.gather(*posts)

    async def _post(self, use: ClaimUse, reason: str, text: str, warning: bool) -> None:
        claim_ref = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "namespace": use.namespace,
                     "name": use.name, "uid": use.uid}
        try:
            await self._event(claim_ref, reason, text, warning)
            claim = await kube.request(self.api, "GET", CLAIMS.format(namespace=use.namespace, name=use.name))
            for consumer in claim.get("status", {}).get("reservedFor", []):
                if consumer.get("resource") == "pods" and not consumer.get("apiGroup"):
                    pod_ref = {"apiVersion": "v1", "kind": "Pod", "namespace": use.namespace,
                               "name": consumer["name"], "uid": consumer["uid"]}
                    await self._event(pod_ref, reason, f"claim {use.name}: {text}", warning)
        except Exception as err:  # best effort: the taint and the health stream carry the state
            log.warning("device health Event not posted", claim=f"{use.namespace}/{use.name}", error=str(err))

    async def _event(self, involved: JSON, reason: str, text: str, warning: bool) -> None:
        body = event_body(involved, reason, text, warning, self.driver, self.node)
        await kube.request(self.api, "POST", f"/api/v1/namespaces/{involved['namespace']}/events", body=body)
        self.posted += 1
