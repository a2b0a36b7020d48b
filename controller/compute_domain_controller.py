"""Keeps each ComputeDomain's workload ResourceClaimTemplate and `status.status` as the pure
plan (`controller.compute_domains`) says, against the API server.

One loop: list every domain, then follow the watch; each domain seen is reconciled once per
change, by itself (a task per domain at a time, the latest version wins). Reconciling a
domain: create its template if it is missing (one POST, once per domain and list: the nodes'
status writes that follow cost none; a template of that name that another owner holds is
left alone, said once in the log and as a Warning Event on the domain), and
write `status.status` when it differs from what the nodes say (one status PATCH). Nothing
is written when nothing changed. A deleted domain needs nothing here: its template carries
the domain as its controller owner, so the garbage collector removes it.

It must not decide what a template holds or when a domain is ready (the plan does), and
holds no state across domains beyond the latest version of each.
"""

from __future__ import annotations

import asyncio
import random
from typing import Final

import structlog

from controller import compute_domains as cd
from dra_driver import kube, metrics
from dra_driver.jsontypes import JSON
from dra_driver.kube import ApiClient, ApiException
from dra_driver.kube.events import event_body

log = structlog.get_logger(__name__)

COMPONENT: Final = "compute-domains"  # the api_errors label
# Paths as the least-privilege test reads them from this source (the chart's ClusterRole).
DOMAINS: Final = "/apis/{group}/v1beta1/computedomains"
DOMAIN_STATUS: Final = "/apis/{group}/v1beta1/namespaces/{namespace}/computedomains/{name}/status"
TEMPLATES: Final = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates"
TEMPLATE: Final = TEMPLATES + "/{name}"
CLAIMS: Final = "/apis/resource.k8s.io/v1/resourceclaims"
NODES: Final = "/api/v1/nodes"
MAX_BACKOFF_SECONDS: Final = 30.0
# How often the domains' entries are checked against their nodes and claims: a node that
# stopped reporting, or whose pod went while it could not unprepare, shows within this.
MEMBERSHIP_SECONDS: Final = 15.0
MAX_DOMAINS: Final = 10_000  # bounds what one list may hold in memory


class ComputeDomainController:
    """The domains of one driver, cluster-wide."""

    def __init__(self, api: ApiClient, driver: str, identity: str = "compute-domain-controller") -> None:
        self.api = api
        self.driver = driver
        self.identity = identity
        self._latest: dict[str, JSON] = {}  # by uid: the newest version seen, not yet reconciled
        self._running: dict[str, asyncio.Task[None]] = {}
        self._warned: set[tuple[str, str]] = set()  # (uid, what was said): said once per domain
        # domains whose template this process made or found: their later events (the status
        # writes of nodes) cost no request; checked again after each list
        self._templated: set[str] = set()
        self._domains: dict[str, JSON] = {}  # by uid: every domain, as last listed or watched

    async def run(self) -> None:
        await asyncio.gather(self._follow(), self._keep_members())

    async def _follow(self) -> None:
        backoff = 0.5
        path = DOMAINS.format(group=self.driver)
        while True:
            try:
                domains, version = await kube.list_all(self.api, path)
                self._templated.clear()
                self._domains = {d["metadata"]["uid"]: d for d in domains[:MAX_DOMAINS]}
                for domain in domains[:MAX_DOMAINS]:
                    self._seen(domain)
                async for kind, domain in kube.watch(self.api, path, version):
                    if kind in ("ADDED", "MODIFIED"):
                        self._seen(domain)
                    elif kind == "DELETED":
                        uid = domain["metadata"]["uid"]
                        self._warned = {w for w in self._warned if w[0] != uid}
                        self._templated.discard(uid)
                        self._domains.pop(uid, None)
                backoff = 0.5
            except kube.TRANSIENT_ERRORS as error:
                metrics.api_error(COMPONENT, error)
                if isinstance(error, ApiException) and error.status == 410:
                    continue
                log.warning("listing or watching ComputeDomains failed; retrying", error=str(error)[:300])
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    def _seen(self, domain: JSON) -> None:
        uid = domain["metadata"]["uid"]
        if uid in self._domains or len(self._domains) < MAX_DOMAINS:
            self._domains[uid] = domain
        self._latest[uid] = domain
        if uid not in self._running:
            self._running[uid] = asyncio.create_task(self._drain(uid), name=f"compute-domain-{uid}")

    async def _drain(self, uid: str) -> None:
        try:
            while uid in self._latest:
                domain = self._latest.pop(uid)
                if (domain["metadata"].get("deletionTimestamp")) is None:
                    await self._reconcile(domain)
        finally:
            del self._running[uid]

    async def _reconcile(self, domain: JSON) -> None:
        meta = domain["metadata"]
        fields = {"domain_namespace": meta["namespace"], "domain_name": meta["name"],
                  "domain_uid": meta["uid"]}
        try:
            await self._ensure_template(domain, fields)
            await self._ensure_status(domain, fields)
        except kube.TRANSIENT_ERRORS as error:
            metrics.api_error(COMPONENT, error)
            if isinstance(error, ApiException) and error.status == 404:
                return  # the domain is gone; the garbage collector has the rest
            log.warning("reconciling a ComputeDomain failed; retrying", error=str(error)[:300], **fields)
            await asyncio.sleep(random.uniform(0.5, 1.0))
            self._latest.setdefault(meta["uid"], domain)

    async def _ensure_template(self, domain: JSON, fields: dict[str, str]) -> None:
        if domain["metadata"]["uid"] in self._templated:
            return
        desired = cd.workload_template(domain, self.driver)
        path = TEMPLATES.format(namespace=domain["metadata"]["namespace"])
        try:
            await kube.request(self.api, "POST", path, desired)
            self._templated.add(domain["metadata"]["uid"])
            log.info("made the domain's ResourceClaimTemplate", template=cd.template_name(domain), **fields)
            return
        except ApiException as e:
            if e.status != 409:
                raise
        where = TEMPLATE.format(namespace=domain["metadata"]["namespace"], name=cd.template_name(domain))
        existing = await kube.request(self.api, "GET", where)
        self._templated.add(domain["metadata"]["uid"])
        if not cd.owned_by(existing, domain):
            await self._warn_once(
                domain, "TemplateTaken",
                f"ResourceClaimTemplate {cd.template_name(domain)} already exists and is not this "
                "ComputeDomain's: delete it, or give the domain another "
                "spec.channel.resourceClaimTemplate.name (the spec is immutable: re-create the domain)",
                fields,
            )

    async def _ensure_status(self, domain: JSON, fields: dict[str, str]) -> None:
        wanted = cd.domain_status(domain)
        if (domain.get("status") or {}).get("status") == wanted:
            return
        meta = domain["metadata"]
        path = DOMAIN_STATUS.format(group=self.driver, namespace=meta["namespace"], name=meta["name"])
        body = {"metadata": {"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]},
                "status": {"status": wanted}}
        try:
            await kube.request(self.api, "PATCH", path, body, content_type="application/merge-patch+json")
        except ApiException as e:
            if e.status == 409:  # a node wrote meanwhile: its MODIFIED event brings the new version
                return
            raise
        log.info("ComputeDomain status", status=wanted, waiting_for=cd.not_ready_nodes(domain), **fields)

    async def _keep_members(self) -> None:
        """Every MEMBERSHIP_SECONDS: the entries of nodes that stopped reporting read NotReady
        (naming them), and those of nodes that hold no channel claim of the domain any more go.
        Two LISTs a pass (the domains' claims by label, the nodes), none while no domain has a node."""
        while True:
            await asyncio.sleep(MEMBERSHIP_SECONDS)
            joined = [d for d in self._domains.values() if cd.nodes_of(d)]  # before the claims are read
            if not joined:
                continue
            try:
                labelled = {"labelSelector": cd.domain_label(self.driver)}
                claims, _ = await kube.list_all(self.api, CLAIMS, query=labelled)
                nodes, _ = await kube.list_all(self.api, NODES, query={"resourceVersion": "0"})
                holding = cd.claim_nodes(claims, self.driver)
                down = cd.down_nodes(nodes)
                for domain in joined:
                    wanted = cd.membership(domain, holding.get(domain["metadata"]["uid"], frozenset()), down)
                    if wanted.stale or wanted.down:
                        await self._write_members(domain, wanted)
            except kube.TRANSIENT_ERRORS as error:
                metrics.api_error(COMPONENT, error)
                log.warning("checking the ComputeDomains' nodes failed; retrying", error=str(error)[:300])

    async def _write_members(self, domain: JSON, wanted: cd.Membership) -> None:
        """One JSON patch on the domain's status, each change guarded by a test of the entry's
        name at its index (a domain that changed meanwhile answers 422: the next pass sees it)."""
        meta = domain["metadata"]
        ops: list[JSON] = []
        # from the end, so that a removal leaves the indices of the entries before it
        for i, entry in reversed(list(enumerate(cd.nodes_of(domain)))):
            name = entry.get("name")
            if name in wanted.stale:
                ops += [{"op": "test", "path": f"/status/nodes/{i}/name", "value": name},
                        {"op": "remove", "path": f"/status/nodes/{i}"}]
            elif name in wanted.down:
                ops += [{"op": "test", "path": f"/status/nodes/{i}/name", "value": name},
                        {"op": "replace", "path": f"/status/nodes/{i}/status", "value": cd.NOT_READY}]
        path = DOMAIN_STATUS.format(group=self.driver, namespace=meta["namespace"], name=meta["name"])
        try:
            await kube.request(self.api, "PATCH", path, ops, content_type="application/json-patch+json")
        except ApiException as e:
            if e.status in (404, 409, 422):
                return
            raise
        fields = {"domain_namespace": meta["namespace"], "domain_name": meta["name"],
                  "domain_uid": meta["uid"]}
        if wanted.down:
            await self._warn_once(domain, "NodeDown", (
                f"node(s) {', '.join(wanted.down)} of the domain stopped reporting: their IMEX daemons are "
                "taken as not ready until they report again or their pods are replaced"), fields)
        if wanted.stale:
            log.info("removed nodes that hold no claim of the domain any more", nodes=list(wanted.stale),
                     **fields)

    async def _warn_once(self, domain: JSON, reason: str, message: str, fields: dict[str, str]) -> None:
        key = (domain["metadata"]["uid"], f"{reason}: {message}")
        if key in self._warned:
            return
        self._warned.add(key)
        log.warning(message, **fields)
        meta = domain["metadata"]
        involved = {"apiVersion": cd.api_version(self.driver), "kind": cd.KIND, "name": meta["name"],
                    "namespace": meta["namespace"], "uid": meta["uid"]}
        body = event_body(involved, reason, message, True, self.driver, self.identity)
        await kube.request(self.api, "POST", f"/api/v1/namespaces/{meta['namespace']}/events", body)


__all__ = ["ComputeDomainController"]
