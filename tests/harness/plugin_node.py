"""One simulated node for an integration test: its Node object, its `dra-driver kubelet-plugin`
(`DriverProcess`) and the kubelet's side of the gRPC (`KubeletSide`), ready once the plugin's
slices are published; afterwards the kubelet side, the plugin, its slices and the Node are
gone, whatever the test did.

It only sets up and clears; what a test checks stays in the test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client

from tests.harness.driver import DriverProcess
from tests.harness.kubelet import KubeletSide
from tests.harness.objects import create_node, delete_node_and_slices, sync_request, wait_for

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@dataclass(frozen=True)
class PluginNode:
    node: str
    plugin: DriverProcess
    side: KubeletSide


def node_slices(api: client.ApiClient, node: str) -> list[dict[str, object]]:
    """The ResourceSlices published for `node`."""
    items: list[dict[str, object]] = sync_request(
        api, "GET", SLICES, query={"fieldSelector": f"spec.nodeName={node}"}
    )["items"]
    return items


@contextlib.contextmanager
def plugin_node(
    api: client.ApiClient,
    kubeconfig: Path,
    node: str,
    profile: str,
    root: Path,
    extra_args: Sequence[str] = (),
    *,
    published: Callable[[], object] | None = None,
    what: str = "the node's slices",
    timeout: float = 60.0,
) -> Iterator[PluginNode]:
    """The Node `node` and its plugin on the simulated `profile`, kept under `root`, started with
    `extra_args`; yielded once `published()` (default: the node has a slice) holds."""
    create_node(api, node)
    plugin = DriverProcess(node, profile, kubeconfig, root, extra_args=tuple(extra_args))
    side = None
    try:
        plugin.start()
        wait_for(what, published or (lambda: node_slices(api, node)), timeout=timeout)
        side = KubeletSide(plugin.registration_socket())
        yield PluginNode(node, plugin, side)
    finally:
        if side is not None:
            side.close()
        plugin.stop()
        delete_node_and_slices(api, node)
