"""The gate of a channel claim's Prepare: its ComputeDomain's IMEX daemon runs on this node,
this node's entry is in the domain's status, and the Prepare is answered only once the local
daemon is READY and the whole domain is Ready (every one of `numNodes` nodes joined and ready).

NVIDIA's driver (v0.5.0) releases a workload as soon as the local daemon is ready, so a job
whose peers are still starting fails on its first memory import (its issue #948); here no
container of a domain starts before every daemon of the domain is ready. The gate waits up to
`wait_seconds` inside the call, polling, then answers what it waits for; the kubelet shows
that in the pod's events and calls again.

Each node writes only its own `status.nodes` entry, by server-side apply with a field manager
of its own, so no controller round trip sits between a daemon turning ready and its peers
learning it; when its daemon stops, the same apply with no entry removes it.

I/O at the edge (the API server, the daemons through a worker thread under the plugin's lock).
It must not write CDI specs or the checkpoint (the prepare transaction does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import structlog

from dra_driver import kube
from dra_driver.imex import domain as cd
from dra_driver.imex.channels import ChannelRequest
from dra_driver.imex.daemons import ImexDaemons, ImexError
from dra_driver.kube import ApiClient, ApiException
from dra_driver.plugin.claims import ClaimRef, describe
from dra_driver.plugin.lock import exclusive

log = structlog.get_logger(__name__)

VERSION: Final = "v1beta1"
DOMAINS: Final = "/apis/{group}/v1beta1/namespaces/{namespace}/computedomains"
DOMAIN: Final = "/apis/{group}/v1beta1/namespaces/{namespace}/computedomains/{name}"
DOMAIN_STATUS: Final = "/apis/{group}/v1beta1/namespaces/{namespace}/computedomains/{name}/status"
MAX_DOMAINS_LISTED: Final = "500"


class ChannelGate:
    """Admits channel claims of ComputeDomains on one node (see the module docstring)."""

    def __init__(
        self,
        api: ApiClient,
        driver: str,
        node: str,
        clique: str | None,
        daemons: ImexDaemons,
        lock_path: Path,
        *,
        node_ip: str | None = None,
        wait_seconds: float = 10.0,
        poll_seconds: float = 0.5,
    ) -> None:
        self.api = api
        self.driver = driver
        self.node = node
        self.clique = clique
        self.daemons = daemons
        self.lock_path = lock_path
        self.node_ip = node_ip
        self.wait_seconds = wait_seconds
        self.poll_seconds = poll_seconds
        self.manager = f"{driver}/{node}"[:128]

    async def _get(self, meta: Mapping[str, Any]) -> kube.JSON:
        path = DOMAIN.format(group=self.driver, namespace=meta["namespace"], name=meta["name"])
        return await kube.request(self.api, "GET", path)

    async def admit(self, ref: ClaimRef, request: ChannelRequest) -> str | None:
        """None once the claim may be prepared; else what it waits for or why it is refused.
        Polls every 0.1 s at first, backing off to `poll_seconds`."""
        if not self.clique:
            return (f"claim {ref}: node {self.node} is in no multi-node NVLink clique, so it has no IMEX "
                    "channel; the ResourceSlice may be stale")
        try:
            path = DOMAINS.format(group=self.driver, namespace=ref.namespace)
            listed = await kube.request(self.api, "GET", path, query={"limit": MAX_DOMAINS_LISTED})
            domain = cd.find_domain(listed.get("items") or [], request.domain_uid)
            if domain is None:
                return (f"claim {ref}: its ComputeDomain (uid {request.domain_uid}) is not in namespace "
                        f"{ref.namespace}: it was deleted, or the claim was copied from another namespace; "
                        "delete the pod, and create the domain before its workload")
            refusal = cd.clique_refusal(domain, self.node, self.clique)
            if refusal:
                return f"claim {ref}: {refusal}"
            ip = self.node_ip or await self._node_ip()
            return await self._wait(ref, request, domain, ip)
        except ImexError as e:
            return f"claim {ref}: the ComputeDomain's IMEX daemon on node {self.node}: {e}"
        except kube.TRANSIENT_ERRORS as e:
            return f"claim {ref}: reading its ComputeDomain failed ({describe(e)[:300]}); the kubelet retries"

    async def _wait(
        self, ref: ClaimRef, request: ChannelRequest, domain: Mapping[str, Any], ip: str
    ) -> str | None:
        meta = domain["metadata"]
        fields = {**ref.log_fields(), "domain": f"{meta['namespace']}/{meta['name']}"}
        deadline = time.monotonic() + self.wait_seconds
        clique = str(self.clique)
        delay = min(0.1, self.poll_seconds)  # a daemon just started is often ready within it
        while True:
            raced = False
            joined = cd.with_entry(domain, cd.own_entry(domain, self.node, ip, clique, False))
            peers = cd.peer_addresses(joined, clique)
            await asyncio.to_thread(self._ensure, meta, ref.uid, request, peers, ip)
            ready = await asyncio.to_thread(self.daemons.ready, request.domain_uid)
            entry = cd.own_entry(domain, self.node, ip, clique, ready)
            if cd.entry_of(domain, self.node) != entry.to_json():
                written = await self._join(domain, entry)
                raced = written is None
                if written is not None:
                    domain = written
                    log.info("joined the ComputeDomain" if ready else "joining the ComputeDomain",
                             status=entry.status, index=entry.index, **fields)
            waits = "another node joined at the same time" if raced else cd.waiting_for(domain)
            if waits is None:
                return None
            if time.monotonic() >= deadline:
                return (f"claim {ref}: waiting for ComputeDomain {meta['namespace']}/{meta['name']}: {waits} "
                        "(no container of the domain starts before every daemon it needs is ready); the "
                        "kubelet retries")
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.poll_seconds)
            domain = await self._get(meta)

    def _ensure(self, meta: Mapping[str, Any], claim_uid: str, request: ChannelRequest, peers: list[str],
                ip: str) -> None:
        with exclusive(self.lock_path):  # Unprepare stops daemons under the same lock
            self.daemons.ensure(request.domain_uid, meta["namespace"], meta["name"], claim_uid, request,
                                peers, ip)

    async def _join(self, domain: Mapping[str, Any], entry: cd.NodeEntry) -> kube.JSON | None:
        """The domain with this node's entry written; None if another node wrote meanwhile (its
        index may be the one picked: the next round reads again and picks again)."""
        try:
            return await self._write_entry(domain["metadata"], [entry.to_json()])
        except ApiException as e:
            if e.status != 409:
                raise
            return None

    async def _write_entry(self, meta: Mapping[str, Any], nodes: list[Any]) -> kube.JSON:
        """Apply this node's entries; with `meta`'s resourceVersion, only onto that version (409
        otherwise), so that two nodes joining at once never pick one index."""
        metadata = {"name": meta["name"], "namespace": meta["namespace"]}
        if meta.get("resourceVersion"):
            metadata["resourceVersion"] = meta["resourceVersion"]
        body = {"apiVersion": f"{self.driver}/{VERSION}", "kind": "ComputeDomain", "metadata": metadata,
                "status": {"nodes": nodes}}
        path = DOMAIN_STATUS.format(group=self.driver, namespace=meta["namespace"], name=meta["name"])
        return await kube.request(
            self.api, "PATCH", path, body,
            query={"fieldManager": self.manager, "force": "true"},
            content_type="application/apply-patch+yaml",
        )

    async def leave(self) -> None:
        """Remove this node's entry from each domain whose daemon here stopped since the last
        call; a domain already gone needs nothing."""
        for uid, namespace, name in self.daemons.left():
            try:
                await self._write_entry({"namespace": namespace, "name": name}, [])
                log.info("left the ComputeDomain", domain=f"{namespace}/{name}", domain_uid=uid)
            except ApiException as e:
                if e.status != 404:
                    log.warning("removing this node from a ComputeDomain's status failed", domain_uid=uid,
                                error=str(e)[:300])
            except kube.TRANSIENT_ERRORS as e:
                log.warning("removing this node from a ComputeDomain's status failed", domain_uid=uid,
                            error=describe(e)[:300])

    async def _node_ip(self) -> str:
        node = await kube.request(self.api, "GET", f"/api/v1/nodes/{self.node}")
        addresses = (node.get("status") or {}).get("addresses") or []
        for kind in ("InternalIP", "ExternalIP"):
            for a in addresses:
                if a.get("type") == kind and a.get("address"):
                    self.node_ip = str(a["address"])
                    return self.node_ip
        raise ImexError(f"node {self.node} has no InternalIP address for its IMEX daemon to bind to")


__all__ = ["ChannelGate"]
