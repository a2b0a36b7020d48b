"""extendedResource against a cluster where a device plugin already serves the name (issue 48
item 3): `helm install --dry-run=server` (Helm asks the real API server, as a real install
and upgrade do) refuses `extendedResource.enabled=true` while some Node's status lists
`nvidia.com/gpu`, naming that node and what to do; without such a node, or with the name
at 0 (no device plugin left), it installs. `helm template`, which cannot ask a cluster,
renders either way.

The Nodes are plain API objects (no kubelet): their status subresource is patched as a
kubelet with NVIDIA's device plugin would report it.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.harness.cluster import ControlPlane
from tests.harness.driver_image import CHART, build_helm
from tests.harness.helm import Helm
from tests.harness.objects import create_node

RESOURCE = "nvidia.com/gpu"
# The chart's gate check passes on every version; the Nodes check is what is tested here.
ON = ("extendedResource.enabled=true", "kubernetesFeatureGates={DRAExtendedResource}")


@pytest.fixture(scope="module")
def helm(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Helm]:
    yield Helm(build_helm(), Path(control_plane.kubeconfig), tmp_path_factory.mktemp("helm-home"))


@pytest.fixture
def nodes(api: client.ApiClient) -> Iterator[list[str]]:
    """Names of the Nodes a test makes; deleted afterwards (the cluster is shared)."""
    made: list[str] = []
    yield made
    for name in made:
        try:
            client.CoreV1Api(api).delete_node(name)
        except ApiException as e:
            if e.status != 404:
                raise


def _node(api: client.ApiClient, made: list[str], name: str, gpus: str | None, capacity: str = "") -> None:
    """A Ready Node; `gpus`: what its kubelet reports as allocatable nvidia.com/gpu (None: not
    listed), `capacity` its capacity (default: the same)."""
    create_node(api, name)
    made.append(name)
    if gpus is not None:
        base = {"cpu": "64", "memory": "512Gi", "pods": "110"}
        status = {"capacity": {**base, RESOURCE: capacity or gpus}, "allocatable": {**base, RESOURCE: gpus}}
        client.CoreV1Api(api).patch_node_status(name, {"status": status})
        node = client.CoreV1Api(api).read_node(name)
        assert node.status.allocatable.get(RESOURCE) == gpus, node.status.allocatable


def _dry_run(helm: Helm, *sets: str) -> subprocess.CompletedProcess[str]:
    release = f"p{uuid.uuid4().hex[:6]}"
    args = ["install", release, str(CHART), "-n", release, "--dry-run=server",
            "--set", f"driverName={release}.example.com"]
    for s in sets:
        args += ["--set", s]
    return helm.run(*args, check=False)


def test_extended_resource_is_refused_where_a_device_plugin_serves_the_name(
    api: client.ApiClient, helm: Helm, nodes: list[str], unique: str
) -> None:
    _node(api, nodes, f"plugin-a-{unique}", "8")
    _node(api, nodes, f"plugin-b-{unique}", "0", capacity="4")  # plugin stopped < 5 min ago
    _node(api, nodes, f"dra-{unique}", None)
    proc = _dry_run(helm, *ON)
    out = proc.stderr + proc.stdout
    assert proc.returncode != 0, f"installed with {RESOURCE} served by a device plugin:\n{out}"
    assert f"extendedResource.enabled=true: {RESOURCE} is already served by a device plugin" in out, out
    assert f"plugin-a-{unique} (8 of 8 allocatable)" in out, out
    assert f"plugin-b-{unique} (0 of 4 allocatable)" in out, out
    assert f"dra-{unique}" not in out, out
    assert "Remove NVIDIA's device plugin from those nodes" in out, out
    assert "leave extendedResource.enabled=false" in out, out
    # The same nodes do not stop an install that leaves the extended resource off,
    assert _dry_run(helm).returncode == 0
    # nor `helm template`, which cannot ask the cluster.
    offline = Helm(helm.binary, None, helm.home)
    rendered = offline.run("template", "r", str(CHART), *(a for s in ON for a in ("--set", s)))
    assert f"extendedResourceName: {RESOURCE}" in rendered.stdout


def test_extended_resource_installs_where_no_device_plugin_serves_the_name(
    api: client.ApiClient, helm: Helm, nodes: list[str], unique: str
) -> None:
    _node(api, nodes, f"dra-{unique}", None)
    _node(api, nodes, f"removed-{unique}", "0")  # its device plugin gone: the kubelet reports 0
    proc = _dry_run(helm, *ON)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert f"extendedResourceName: {RESOURCE}" in proc.stdout, proc.stdout
