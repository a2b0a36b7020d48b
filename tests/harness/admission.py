"""The chart's admission policies in force for a test module: installed, waited on, removed.

Helpers only: what a policy must admit or refuse stays in the tests.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

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


@dataclass
class ClassesInForce:
    """DeviceClasses (labelled for a policy's paramRef selector) whose spec.config a test sets,
    and waits on until the API server's policies see it: the policies read params from an
    informer, a moment behind the write. The wait is a barrier class (`sync`) written last,
    labelled alike: its config's thread percentage alternates, and a claim of it with
    another one (`sync_probe`) is refused only once the barrier's newest config is seen; the
    API server's watch is in write order, so the classes written before it are seen too."""

    api: client.ApiClient
    namespace: str
    labels: dict[str, str]
    names: Sequence[str]
    sync: str
    sync_probe: Callable[[str, str, int, int], bool]  # (namespace, class, its pct, the claim's) -> refused
    sync_config: Callable[[int], list[dict[str, Any]]]  # a class config with that thread percentage
    configs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    generation: int = 0
    dirty: bool = True

    def _put(self, name: str, config: list[dict[str, Any]]) -> None:
        path = f"/apis/resource.k8s.io/v1/deviceclasses/{name}"
        body: dict[str, Any] = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                "metadata": {"name": name, "labels": self.labels},
                                "spec": {"config": config} if config else {}}
        try:
            current = sync_request(self.api, "GET", path)
            body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        except ApiException as e:
            if e.status != 404:
                raise
            sync_request(self.api, "POST", "/apis/resource.k8s.io/v1/deviceclasses", body)
            return
        sync_request(self.api, "PUT", path, body)

    class Refused(Exception):
        """A class's write was refused (`error`), by a policy or the API server's validation."""

        def __init__(self, name: str, error: ApiException) -> None:
            super().__init__(f"DeviceClass {name}: {error}")
            self.name, self.error = name, error

    def set(self, configs: dict[str, list[dict[str, Any]]]) -> None:
        """Give each class its config in `configs` (none if absent), waiting until each write is
        in force before the next (a class written is checked beside the others): first the
        classes whose config goes, then those given one, in name order. A refused write raises
        Refused (the classes before it written, the rest as they were)."""
        first = not self.generation
        changed = [n for n in sorted(self.names) if first or configs.get(n, []) != self.configs.get(n, [])]
        for name in [n for n in changed if first or self.configs.get(n)]:
            self._put(name, [])
            self.configs[name] = []
            self.dirty = True
        self._barrier()
        for name in [n for n in changed if configs.get(n)]:
            try:
                self._put(name, configs[name])
            except ApiException as e:
                if e.status in (400, 403, 422):
                    raise ClassesInForce.Refused(name, e) from e
                raise
            self.configs[name] = configs[name]
            self.dirty = True
            self._barrier()

    def _barrier(self) -> None:
        """Wait until the policies see every class written so far."""
        if not self.dirty:
            return
        old, new = 10 + 10 * (self.generation % 2), 10 + 10 * ((self.generation + 1) % 2)
        self.generation += 1
        self._put(self.sync, self.sync_config(new))
        wait_for(f"DeviceClass {self.sync} at generation {self.generation} to be seen by the policies",
                 lambda: self.sync_probe(self.namespace, self.sync, new, old), timeout=30, interval=0.005)
        self.dirty = False

    def delete(self) -> None:
        for name in [*self.names, self.sync]:
            with contextlib.suppress(ApiException):
                sync_request(self.api, "DELETE", f"/apis/resource.k8s.io/v1/deviceclasses/{name}")
