"""The chart's admission policies in force for a test module: installed, waited on, removed.

Helpers only: what a policy must admit or refuse stays in the tests.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from tests.harness.cluster import ControlPlane
from tests.harness.objects import (
    create_namespace,
    create_object,
    delete_object,
    sync_client,
    sync_request,
    wait_for,
)


@dataclass
class PolicyBench:
    """Clients for concurrent dry-run writes, and the namespace the policies were seen in force in."""

    clients: list[client.ApiClient]
    namespace: str


@contextlib.contextmanager
def policies_in_force(
    api: client.ApiClient, docs: Sequence[dict[str, Any]], prefix: str, refuses: Callable[[str], bool],
    labels: dict[str, str] | None = None,
) -> Iterator[str]:
    """Install `docs` (rendered ValidatingAdmissionPolicies and their bindings) and a namespace
    `<prefix>-<random>`, and yield its name once `refuses(namespace)` holds (a policy takes
    effect a moment after it is written; `labels`: the namespace's); the namespace and the
    policies go after."""
    for doc in docs:
        create_object(api, doc)
    namespace = f"{prefix}-{random.randrange(16**6):06x}"
    create_namespace(api, namespace, labels)
    try:
        wait_for("the policies to take effect", lambda: refuses(namespace), timeout=60)
        yield namespace
    finally:
        sync_request(api, "DELETE", f"/api/v1/namespaces/{namespace}")
        for doc in reversed(docs):
            delete_object(api, doc)


@contextlib.contextmanager
def policy_bench(
    control_plane: ControlPlane, api: client.ApiClient, docs: Sequence[dict[str, Any]], prefix: str,
    refuses: Callable[[str], bool], threads: int, labels: dict[str, str] | None = None,
) -> Iterator[PolicyBench]:
    """`policies_in_force`, with `threads` clients of their own for concurrent checks."""
    with policies_in_force(api, docs, prefix, refuses, labels) as namespace:
        yield PolicyBench([sync_client(str(control_plane.kubeconfig)) for _ in range(threads)], namespace)
