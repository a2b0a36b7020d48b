"""Claims served to a preparer without an API server (unit tests, and the GPU host's tests,
where the Kubernetes client is not installed: this module must not import it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from dra_driver.plugin.claims import ClaimGone, ClaimRef, ClaimRejected


def with_spec(claim: dict[str, Any]) -> dict[str, Any]:
    """`claim` as the API server would hold it: a test that writes only the allocation gets
    the spec that allocation was made for (its requests with their counts, its FromClaim
    configs); a claim with a spec of its own is returned as it is."""
    if "spec" in claim:
        return claim
    allocated = ((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}
    results = allocated.get("results") or []
    counts = Counter(str(r.get("request", "")) for r in results)
    admin = {str(r.get("request", "")) for r in results if r.get("adminAccess")}
    config = [
        {k: v for k, v in c.items() if k != "source"}
        for c in allocated.get("config") or []
        if c.get("source", "FromClaim") == "FromClaim"
    ]
    requests: dict[str, dict[str, Any]] = {}
    for name, count in counts.items():
        base, _, sub = name.partition("/")
        exactly: dict[str, Any] = {"deviceClassName": "any", "count": count}
        if name in admin:
            exactly["adminAccess"] = True
        if sub:  # a subrequest: chosen from the request's firstAvailable list
            requests.setdefault(base, {"name": base, "firstAvailable": []})["firstAvailable"].append(
                {"name": sub, **exactly}
            )
        else:
            requests[base] = {"name": base, "exactly": exactly}
    return {**claim, "spec": {"devices": {"requests": list(requests.values()), "config": config}}}


class ClaimsInMemory:
    """The claim source of a preparer, as the API server would serve these claims."""

    def __init__(self, *claims: dict[str, Any]) -> None:
        self.claims = {c["metadata"]["uid"]: with_spec(c) for c in claims}

    async def read(self, refs: Sequence[ClaimRef]) -> dict[str, dict[str, Any] | ClaimRejected]:
        return {r.uid: self.claims.get(r.uid) or ClaimGone(f"no claim {r}") for r in refs}

    async def allocated_here(self, driver: str, pool: str) -> list[dict[str, Any]] | None:
        return list(self.claims.values())
