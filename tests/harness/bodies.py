"""The bodies of the objects the tests create around claims: ResourceClaims,
ResourceClaimTemplates and the pods that use them. Plain data only: nothing here talks to
the API server.
"""

from __future__ import annotations

from collections.abc import Sequence

from dra_driver.jsontypes import JSON


def claim_body(name: str, devices: JSON) -> JSON:
    """A standalone ResourceClaim of `devices` (its spec.devices)."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": devices}}


def claim_template(name: str, devices: JSON) -> JSON:
    """A ResourceClaimTemplate of `devices` (its spec.spec.devices)."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": devices}}}


def claim_pod(
    name: str,
    source: JSON,
    node: str | None = None,
    requests: Sequence[str] = (),
    command: Sequence[str] = ("sleep", "3600"),
) -> JSON:
    """A busybox pod whose claim "gpu" is `source` (resourceClaimName or
    resourceClaimTemplateName): one container per request named in `requests`, or one container
    "main" with the whole claim; pinned to `node` when one is given."""
    uses: list[JSON] = [{"request": r} for r in requests] or [{}]
    containers = [
        {"name": f"c{i}" if requests else "main", "image": "busybox:1.37", "command": list(command),
         "resources": {"claims": [{"name": "gpu", **use}]}}
        for i, use in enumerate(uses)
    ]
    spec: JSON = {"automountServiceAccountToken": False, "resourceClaims": [{"name": "gpu", **source}],
                  "containers": containers}
    if node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
