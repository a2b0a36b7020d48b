"""The node tier's cluster for the driver as a DaemonSet: a control plane, real kubelets with
the driver's image imported and the GPU label set, and the kubernetes Service's address
proxied from the first node (the driver's pods reach the API server through it).

Helpers only: what each test installs (chart, manifests) and checks is its own. Leaving the
`with` block stops the nodes, then the proxy and the control plane (its files are kept).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import structlog
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.harness.cluster import ControlPlane
from tests.harness.driver_image import DriverImage, build_driver_image, build_helm
from tests.harness.helm import Helm
from tests.harness.node import Node, Nodes, NodeSpec, node_tokens
from tests.harness.objects import sync_client, sync_request, wait_for
from tests.harness.service_proxy import ServiceProxy

logger = structlog.get_logger(__name__)

GPU_LABEL = "nvidia.com/gpu.present"  # the chart's DaemonSets select nodes by it


@dataclass(frozen=True)
class DaemonSetCluster:
    cp: ControlPlane
    api: client.ApiClient
    nodes: Nodes
    image: DriverImage
    work: Path  # this cluster's scratch folder

    def helm(self) -> Helm:
        """A helm client of this cluster."""
        return Helm(build_helm(), self.cp.kubeconfig, self.work / "helm")


@dataclass(frozen=True)
class OneNodeRelease:
    """A one-node DaemonSetCluster with its helm client: what a one-node chart test holds."""

    cp: ControlPlane
    api: client.ApiClient
    node: Node
    helm: Helm
    image: DriverImage


def label_gpu_node(api: client.ApiClient, name: str) -> bool | None:
    """True once labelled; None when the kubelet's status update came between GET and PUT (409)."""
    found = sync_request(api, "GET", f"/api/v1/nodes/{name}")
    found["metadata"].setdefault("labels", {})[GPU_LABEL] = "true"
    try:
        sync_request(api, "PUT", f"/api/v1/nodes/{name}", found)
    except ApiException as e:
        if e.status == 409:
            return None
        raise
    return True


@contextmanager
def daemonset_cluster(
    tmp_path_factory: pytest.TempPathFactory, name: str, specs: Sequence[NodeSpec]
) -> Iterator[DaemonSetCluster]:
    """The cluster of `specs` in a new scratch folder `name`, with the driver's image built."""
    if os.geteuid() != 0:
        pytest.fail("the node tier runs real kubelets and containerd: it needs root")
    image = build_driver_image()
    archive_mb = round(image.archive.stat().st_size / 2**20, 1)
    logger.info("driver image ready", image=image.name, archive=str(image.archive),
                seconds=round(image.build_seconds, 1), archive_mb=archive_mb)
    work = tmp_path_factory.mktemp(name)
    cp = ControlPlane.start(
        work_dir=work / "cp", node_lifecycle=True, extra_tokens=node_tokens([s.name for s in specs])
    )
    nodes: Nodes | None = None
    proxy: ServiceProxy | None = None
    try:
        nodes = Nodes.start(cp, specs, daemonset=True, keep_files=os.environ.get("DRA_NODE_KEEP") == "1")
        api = sync_client(str(cp.kubeconfig))
        for node in nodes.nodes.values():
            t0 = time.monotonic()
            node.import_images({image.name: image.archive})
            logger.info("driver image imported", node=node.name, seconds=round(time.monotonic() - t0, 1))
            wait_for(f"the GPU label on {node.name}", partial(label_gpu_node, api, node.name), timeout=30)
        service = wait_for(
            "the kubernetes Service",
            lambda: sync_request(api, "GET", "/api/v1/namespaces/default/services/kubernetes"),
        )
        first = next(iter(nodes.nodes.values()))
        port = int(service["spec"]["ports"][0]["port"])
        target = ("127.0.0.1", cp.api_port)
        proxy = ServiceProxy(service["spec"]["clusterIP"], port, target, first.link).start()
        yield DaemonSetCluster(cp, api, nodes, image, work)
    finally:
        # The proxy outlives the nodes: a plugin pod killed with its node closes its API
        # connection through it, where with the Service address gone its socket would retransmit
        # the FIN for about 100 s and keep the pod's network namespace (tests.harness.host_links).
        try:
            if nodes is not None:
                nodes.stop()
        finally:
            if proxy is not None:
                proxy.stop()
            cp.stop(remove=False)
