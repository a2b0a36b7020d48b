"""`kubectl apply -f deploy/base` on a real node: the plain manifests (the chart rendered by
deploy/base/render.sh) start a plugin that registers and prepares a pod's claim.

One simulated 8x H200 node of its own with a real kubelet + containerd + runc, a control
plane of its own and the `kubernetes` Service reachable from pods (tests.harness.service_proxy),
as in tests/node/test_helm.py. Every object of deploy/base is created as it is, with the two
edits a node without GPUs needs and nothing else: the DaemonSet's image is the one built from
the repository's Dockerfile, and the plugin runs `--simulate hgx-h200` instead of reading the
driver root (its RBAC, policies, securityContext, mounts and probes are those of the files).
"""

from __future__ import annotations

import copy
import io
import json
import re
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from tests.harness.driver import DRIVER
from tests.harness.driver_image import CHART, build_driver_image
from tests.harness.examples import device_class_files
from tests.harness.node import NodeSpec
from tests.harness.objects import (
    RESOURCE_API,
    apply_documents,
    create_namespace,
    create_object,
    sync_request,
    wait_for,
)
from tests.node import pods
from tests.node.daemonset_cluster import DaemonSetCluster, daemonset_cluster

JSON = dict[str, Any]
PROFILE = "hgx-h200"
NODE = "base-a"
NAMESPACE = "gpu-dra-driver"
BASE = CHART.parents[1] / "base"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSetCluster]:
    with daemonset_cluster(tmp_path_factory, "base-cluster", (NodeSpec(NODE, PROFILE),)) as base:
        yield base


def for_a_simulated_node(daemonset: JSON, image: str) -> JSON:
    """The two edits: the test image, and --simulate instead of the driver root."""
    ds = copy.deepcopy(daemonset)
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    container["image"] = image
    args = [a for a in container["args"] if not a.startswith(("--driver-root=", "--host-driver-root="))]
    container["args"] = [*args, f"--simulate={PROFILE}"]
    return ds


def _documents() -> list[JSON]:
    return [d for p in sorted(BASE.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def test_the_plain_manifests_start_a_plugin_that_prepares_a_claim(env: DaemonSetCluster) -> None:
    docs = _documents()
    assert {d["kind"] for d in docs} >= {"Namespace", "ClusterRole", "DaemonSet", "ValidatingAdmissionPolicy"}
    first = sorted(docs, key=lambda d: (d["kind"] != "Namespace", d["kind"] == "DaemonSet"))
    for doc in first:
        if doc["kind"] == "DaemonSet":
            doc = for_a_simulated_node(doc, env.image.name)
        try:
            create_object(env.api, doc, NAMESPACE)
        except ApiException as e:
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} from deploy/base: {e.body}") from e
    for path in device_class_files():
        applied = apply_documents(env.api, path, "default")
        assert not applied.problems, f"{path.name}: {applied.problems}"

    def ready_plugin() -> JSON | None:
        items = sync_request(env.api, "GET", f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
        for pod in items:
            conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
            if conditions.get("Ready") == "True":
                return pod  # type: ignore[no-any-return]
        return None

    plugin = wait_for("the plugin pod of deploy/base Ready", ready_plugin, timeout=120)
    assert plugin["spec"]["nodeName"] == NODE
    (status,) = plugin["status"]["containerStatuses"]
    assert status["restartCount"] == 0, status

    def published() -> list[JSON]:
        query = {"fieldSelector": f"spec.driver={DRIVER},spec.nodeName={NODE}"}
        items: list[JSON] = sync_request(env.api, "GET", f"{RESOURCE_API}/resourceslices", query=query)[
            "items"
        ]
        return [s for s in items if s["spec"].get("devices")]

    wait_for("the node's slices, written by the plugin's own token", published, timeout=60)
    namespace = "base-pods"
    create_namespace(env.api, namespace)
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu"},
        "spec": {
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}
        },
    }
    pods.create(env.api, namespace, template, pods.gpu_pod("gpu-user", templates={"gpu": "one-gpu"}))
    t0 = time.monotonic()
    pod = pods.wait_running(env.api, namespace, "gpu-user", timeout=90)
    (result,) = pods.container_allocations(env.api, pod, "main")
    assert result["pool"] == NODE
    seen = pods.gpu_minors(pods.logged_devices(env.nodes[NODE], pod, "main"))
    assert len(seen) == 1, f"the pod sees GPUs {seen}"
    print(f"pod with a claim Running {time.monotonic() - t0:.1f} s after create")
    pods.delete_pod(env.api, namespace, "gpu-user")
    pods.wait_gone(env.api, namespace, "gpu-user")


def test_deploy_base_holds_only_files_it_applies() -> None:
    """Everything in deploy/base is either a manifest or its generator."""
    assert {p.suffix for p in BASE.iterdir()} <= {".yaml", ".sh"}, sorted(p.name for p in BASE.iterdir())
    assert Path(BASE / "render.sh").stat().st_mode & 0o111


def test_the_image_comes_with_an_sbom_of_what_it_runs() -> None:
    """hack/image/build.sh leaves the image's CycloneDX SBOM (made in the build, read out of
    the image) beside the archive; it names the driver and the packages it imports."""
    image = build_driver_image()
    sbom = json.loads((image.archive.parent / "sbom.cdx.json").read_text())
    assert sbom["bomFormat"] == "CycloneDX"
    assert sbom["metadata"]["component"]["name"] == "gpu-dra-driver"
    names = {c["name"].lower().replace("_", "-") for c in sbom["components"]}
    assert {"grpcio", "h11", "prometheus-client", "structlog", "nvidia-ml-py"} <= names, sorted(names)
    assert all(c.get("version") and c.get("purl") for c in sbom["components"])


def test_the_image_names_its_base_by_digest_and_holds_only_the_driver() -> None:
    """hack/image/build.sh builds FROM the base by its manifest digest and the image says so
    in its OCI labels (base.name, base.digest; base.ref beside the archive); the one layer the
    image adds is /opt/dra-driver: the driver's environment, without pip or setuptools, and
    its SBOM. Read from the OCI archive itself."""
    image = build_driver_image()
    with tarfile.open(image.archive) as archive:

        def blob(digest: str) -> bytes:
            f = archive.extractfile("blobs/sha256/" + digest.removeprefix("sha256:"))
            assert f is not None, digest
            return f.read()

        index = archive.extractfile("index.json")
        assert index is not None, "no index.json: not an OCI archive"
        (entry,) = json.loads(index.read())["manifests"]
        manifest = json.loads(blob(entry["digest"]))
        labels = json.loads(blob(manifest["config"]["digest"]))["config"]["Labels"]
        layer = io.BytesIO(blob(manifest["layers"][-1]["digest"]))
        with tarfile.open(fileobj=layer, mode="r:*") as added:
            paths = added.getnames()
    oci = "org.opencontainers.image"
    digest, base = labels[f"{oci}.base.digest"], labels[f"{oci}.base.name"]
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), labels
    assert base.endswith(f"@{digest}"), labels
    assert (image.archive.parent / "base.ref").read_text().strip() == base
    assert {p.split("/", 2)[1] for p in paths if "/" in p} == {"dra-driver"}, sorted(paths)[:20]
    assert "opt/dra-driver/sbom.cdx.json" in paths and "opt/dra-driver/bin/dra-driver" in paths
    top = {p.split("site-packages/", 1)[1].split("/")[0] for p in paths if "site-packages/" in p}
    assert {"dra_driver", "controller", "grpc", "h11"} <= top, sorted(top)
    leftovers = {t for t in top if re.match(r"(pip|setuptools|pkg_resources|_distutils_hack|wheel)\b", t)}
    assert not leftovers, f"build tools in the driver's environment: {sorted(leftovers)}"
    assert not [p for p in paths if re.search(r"/bin/(pip|easy_install)", p)]
