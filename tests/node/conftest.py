"""Fixtures of the node tier: one control plane and three real nodes for the whole tier.

The nodes are the demo's simulated boxes (8x V100 cube-mesh, 4x A100 bridged pairs,
8x H200 NVSwitch), each a real kubelet + containerd + runc with its own
`dra-driver kubelet-plugin --simulate <profile>` (tests.harness.node). The control plane
runs the node-lifecycle controller and knows each kubelet's `system:node:<name>` token.
Each test works in its own namespace and deletes its pods, so the GPUs come back.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from kubernetes import client

from tests.harness.cluster import ControlPlane
from tests.harness.examples import DEMO_NODES, DeviceMap, device_class_files, wait_for_slices
from tests.harness.node import Nodes, NodeSpec, node_cluster
from tests.harness.objects import apply_documents, create_namespace, sync_client, sync_request

SPECS = tuple(NodeSpec(n.name, n.profile) for n in DEMO_NODES)
_counter = itertools.count()


@dataclass
class NodeCluster:
    cp: ControlPlane
    api: client.ApiClient
    nodes: Nodes
    devices: DeviceMap  # (pool, device) -> the device of the published slice

    def minor(self, pool: str, device: str) -> int:
        return int(self.devices[(pool, device)]["attributes"]["minor"]["int"])

    def uuid(self, pool: str, device: str) -> str:
        return str(self.devices[(pool, device)]["attributes"]["uuid"]["string"])


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    if os.geteuid() != 0:
        pytest.fail("the node tier runs real kubelets and containerd: it needs root")
    # DRA_NODE_KEEP=1 keeps the nodes' files (logs, configs) under /tmp/dra-nodes-* for a look after.
    with node_cluster(
        SPECS, tmp_path_factory.mktemp("node-cluster"), keep_files=os.environ.get("DRA_NODE_KEEP") == "1"
    ) as (cp, nodes):
        api = sync_client(str(cp.kubeconfig))
        devices = wait_for_slices(api, [n.driver for n in nodes.nodes.values() if n.driver])
        for path in device_class_files():
            applied = apply_documents(api, path, "default")
            assert not applied.problems, f"{path.name}: {applied.problems}"
        yield NodeCluster(cp=cp, api=api, nodes=nodes, devices=devices)


@pytest.fixture
def namespace(cluster: NodeCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"n{next(_counter)}-{request.node.name.lower().replace('_', '-')[:40].strip('-')}"
    name = "".join(c for c in name if c.isalnum() or c == "-").strip("-")
    create_namespace(cluster.api, name)
    yield name
    # Pods have a 1 s grace period; their claims go once the kubelet confirmed the deletion.
    sync_request(cluster.api, "DELETE", f"/api/v1/namespaces/{name}/pods")
    sync_request(cluster.api, "DELETE", f"/api/v1/namespaces/{name}")
