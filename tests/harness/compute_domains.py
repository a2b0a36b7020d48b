"""ComputeDomains on a test control plane: the chart's CRD installed and `dra-driver
compute-domain-controller` running for as long as the `with` block, and the domain builder.

It only sets up and clears; what a test checks stays in the test.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from controller import compute_domains as cd
from dra_driver.gpu.sim.profiles import resolve_profile_path
from dra_driver.imex.channels import CHANNEL_DEVICE
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER
from tests.harness.driver_image import render_chart
from tests.harness.kubelet import ClaimName, KubeletSide, prepared_cdi_ids
from tests.harness.objects import sync_request, wait_for
from tests.harness.plugin_node import node_slices

CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"
GB200 = "gb200-nvl-node"  # one tray of a GB200 NVL72 rack: its GPUs in clique 32766


def clique_profile(path: Path, clique_id: int) -> Path:
    """The GB200 profile with its GPUs in another clique of the same fabric, written to `path`."""
    text = resolve_profile_path(GB200).read_text()
    path.write_text(text.replace("clique_id: 32766", f"clique_id: {clique_id}"))
    return path


def channel_published(api: client.ApiClient, node: str) -> bool:
    """The node's slices publish its IMEX channel."""
    return any(d["name"] == CHANNEL_DEVICE for s in node_slices(api, node)
               for d in s["spec"].get("devices", []))  # type: ignore[index]


def domains_path(driver: str, namespace: str | None = None) -> str:
    return f"/apis/{driver}/v1beta1" + (f"/namespaces/{namespace}" if namespace else "") + "/computedomains"


def domain(name: str, template: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": cd.api_version(DRIVER),
        "kind": "ComputeDomain",
        "metadata": {"name": name},
        "spec": {"channel": {"resourceClaimTemplate": {"name": template}}, **spec},
    }


def chart_documents(template: str) -> list[dict[str, Any]]:
    """One of the chart's templates, rendered with computeDomains.enabled=true."""
    return render_chart(Path(tempfile.mkdtemp(prefix="cd-helm-")), "computeDomains.enabled=true",
                        show_only=f"templates/{template}")


@contextlib.contextmanager
def compute_domain_controller(
    control_plane: ControlPlane, api: client.ApiClient
) -> Iterator[subprocess.Popen[bytes]]:
    """The CRD established, the chart's channel DeviceClass applied and the controller running;
    all gone afterwards."""
    (crd,) = chart_documents("computedomain-crd.yaml")
    try:
        sync_request(api, "POST", CRDS, crd)
    except ApiException as e:
        if e.status != 409:
            raise

    def established() -> bool:
        got = sync_request(api, "GET", f"{CRDS}/{crd['metadata']['name']}")
        return any(c["type"] == "Established" and c["status"] == "True"
                   for c in (got.get("status") or {}).get("conditions") or [])

    wait_for("the ComputeDomain CRD established", established)
    wait_for("ComputeDomains served", lambda: sync_request(api, "GET", domains_path(DRIVER)) is not None)
    (channel_class,) = [d for d in chart_documents("deviceclasses.yaml")
                        if d["metadata"]["name"] == cd.channel_class(DRIVER)]
    sync_request(api, "POST", CLASSES, channel_class)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dra_driver", "--log-format", "json", "compute-domain-controller",
         "--driver-name", DRIVER, "--kubeconfig", str(control_plane.kubeconfig)],
    )
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        sync_request(api, "DELETE", f"{CLASSES}/{cd.channel_class(DRIVER)}")
        sync_request(api, "DELETE", f"{CRDS}/{crd['metadata']['name']}")
        wait_for("the ComputeDomain CRD gone", lambda: not exists(api, f"{CRDS}/{crd['metadata']['name']}"))


def prepare_all(
    sides: Mapping[str, KubeletSide], claims: Mapping[str, ClaimName]
) -> list[tuple[tuple[str, ...], str]]:
    """Each node's Prepare of its channel claim, all at once, as the kubelets of a job's nodes
    send them (each waits in its plugin for the others to join): (CDI ids, error) per node."""
    def prepare(node: str) -> tuple[tuple[str, ...], str]:
        return prepared_cdi_ids(sides[node].prepare(claims[node]), claims[node].uid)

    with ThreadPoolExecutor(max(1, len(claims))) as pool:
        return list(pool.map(prepare, list(claims)))


def exists(api: client.ApiClient, path: str) -> bool:
    try:
        sync_request(api, "GET", path)
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return True
