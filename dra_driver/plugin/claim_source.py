"""Read the ResourceClaims that the kubelet asks about, from the API server, within a deadline.

The kubelet gives each NodePrepareResources call 45 s. Every claim of a call is read
with at most `concurrency` GETs in flight (a call may name thousands of claims; each read
holds its answer in memory until used), fewer than the daemon's connections to the API
server, so that one call's reads never hold every connection that other calls' reads, the
claim status writer and the slice publisher wait for. All of a call's reads share one
deadline: a hung API server gives each waiting claim a clear error ("timed out after N s
reading ResourceClaim ns/name from the API server") well before the kubelet gives up,
never an empty one. Once `max_missing` claims of one call were found not to exist, the
claims of that call not yet read are answered without a GET ("not read: ... of this call
do not exist"; the kubelet asks again): a call naming a thousand claims that do not exist
costs a few dozen GETs, not a thousand, and each later call its own few. Such an answer is
a ClaimRejected, never a ClaimGone, so nobody concludes from it that a claim is gone. The
answers are plain JSON, checked by `dra_driver.plugin.claims`.

`allocated_here` lists the claims allocated to this node's pool, for re-adopting the CDI
specs of running pods after the checkpoint was lost. This module never touches node
state and holds nothing across calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog

from dra_driver import kube, metrics
from dra_driver.kube import ApiClient
from dra_driver.plugin.claims import ClaimGone, ClaimRef, ClaimRejected, describe

log = structlog.get_logger(__name__)

CLAIMS_API = "/apis/resource.k8s.io/v1"
DEFAULT_TIMEOUT_SECONDS = 30.0  # the kubelet's own call timeout is 45 s
DEFAULT_CONCURRENCY = 4  # per call; the daemon has 8 connections to the API server (node/daemon.py)
DEFAULT_MAX_MISSING = 16  # claims found not to exist before the rest of the call is left unread


def _describe(e: BaseException) -> str:
    """An API error as a person reads it: status, reason and the start of the server's answer."""
    if isinstance(e, kube.ApiException):
        return f"HTTP {e.status} {e.reason or ''}".strip() + (f": {str(e.body)[:300]}" if e.body else "")
    return describe(e)


class ClaimReader:
    """GETs claims for Prepare; lists this node's allocated claims for recovery."""

    def __init__(
        self,
        api: ApiClient,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        concurrency: int = DEFAULT_CONCURRENCY,
        max_missing: int = DEFAULT_MAX_MISSING,
    ) -> None:
        self._api = api
        self.timeout = timeout
        self._concurrency = concurrency
        self._max_missing = max_missing

    async def read(self, refs: Sequence[ClaimRef]) -> dict[str, kube.JSON | ClaimRejected]:
        """Each claim by UID, or the reason it could not be read; all within `timeout`."""
        gate = asyncio.Semaphore(self._concurrency)
        missing: list[ClaimRef] = []

        async def one(ref: ClaimRef) -> kube.JSON | ClaimRejected:
            async with gate:
                if len(missing) >= self._max_missing:
                    return ClaimRejected(
                        f"not read: {len(missing)} claims of this call do not exist (e.g. "
                        f"{missing[0].namespace}/{missing[0].name}), so its other claims were not read "
                        f"from the API server; the kubelet will retry"
                    )
                path = f"{CLAIMS_API}/namespaces/{ref.namespace}/resourceclaims/{ref.name}"
                return await kube.request(self._api, "GET", path, timeout=self.timeout)

        async def guarded(ref: ClaimRef) -> kube.JSON | ClaimRejected:
            try:
                async with asyncio.timeout(self.timeout):  # the wait for the gate counts too
                    return await one(ref)
            except TimeoutError as e:
                metrics.api_error("claims", e)
                return ClaimRejected(
                    f"timed out after {self.timeout:g} s reading ResourceClaim {ref.namespace}/{ref.name} "
                    "from the API server; the kubelet will retry"
                )
            except kube.TRANSIENT_ERRORS as e:
                metrics.api_error("claims", e)
                if isinstance(e, kube.ApiException) and e.status == 404:
                    missing.append(ref)
                    return ClaimGone(f"claim {ref.namespace}/{ref.name} does not exist (any more)")
                where = f"ResourceClaim {ref.namespace}/{ref.name}"
                return ClaimRejected(f"reading {where} from the API server failed: {_describe(e)}")

        if len(refs) == 1:  # the usual call: no task to gather
            return {refs[0].uid: await guarded(refs[0])}
        answers = await asyncio.gather(*(guarded(r) for r in refs))
        return {r.uid: a for r, a in zip(refs, answers, strict=True)}

    async def allocated_here(self, driver: str, pool: str) -> list[kube.JSON] | None:
        """Every claim with a device of `driver` allocated in `pool`; None if the API server
        could not be asked (then nobody may conclude that a claim is gone)."""
        try:
            found, _ = await kube.list_all(
                self._api, f"{CLAIMS_API}/resourceclaims", keep=lambda c: allocated_in(c, driver, pool),
                timeout=self.timeout,
            )
            return found
        except kube.TRANSIENT_ERRORS as e:
            metrics.api_error("claims", e)
            log.error("could not list ResourceClaims from the API server", error=_describe(e))
            return None


def allocated_in(claim: kube.JSON, driver: str, pool: str) -> bool:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return any(r.get("driver") == driver and r.get("pool") == pool for r in results)
