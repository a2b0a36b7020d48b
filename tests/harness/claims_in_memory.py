"""Claims served to a preparer without an API server (unit tests, and the GPU host's tests,
where the Kubernetes client is not installed: this module must not import it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dra_driver.plugin.claims import ClaimRef, ClaimRejected


class ClaimsInMemory:
    """The claim source of a preparer, as the API server would serve these claims."""

    def __init__(self, *claims: dict[str, Any]) -> None:
        self.claims = {c["metadata"]["uid"]: c for c in claims}

    async def read(self, refs: Sequence[ClaimRef]) -> dict[str, dict[str, Any] | ClaimRejected]:
        return {r.uid: self.claims.get(r.uid) or ClaimRejected(f"no claim {r}") for r in refs}

    async def allocated_here(self, driver: str, pool: str) -> list[dict[str, Any]] | None:
        return list(self.claims.values())
