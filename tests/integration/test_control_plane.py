"""The foundation works against the real control plane: scheduling by a ResourceSlice's
capacity through the real resourceclaim controller and scheduler, CEL validation by the
real API server, and the kubectl built with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.harness.bodies import claim_pod, claim_template
from tests.harness.cluster import ControlPlane
from tests.harness.objects import create_device_class, create_node, sync_request, wait_for

DRIVER = "foundation.test.example.com"
BIG_ENOUGH = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("80Gi")) >= 0'


def _slice(node: str, suffix: str) -> dict[str, object]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{suffix}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {"name": "small", "capacity": {"memory": {"value": "40Gi"}}},
                {"name": "large", "capacity": {"memory": {"value": "80Gi"}}},
            ],
        },
    }


def test_scheduler_allocates_the_device_with_enough_memory(
    api: client.ApiClient, namespace: str, unique: str
) -> None:
    node = f"node-{unique}"
    create_node(api, node)
    sync_request(api, "POST", "/apis/resource.k8s.io/v1/resourceslices", _slice(node, unique))
    cls = f"foundation-{unique}"
    create_device_class(api, cls, f'device.driver == "{DRIVER}"')
    selectors = [{"cel": {"expression": BIG_ENOUGH}}]
    big = {"name": "gpu", "exactly": {"deviceClassName": cls, "selectors": selectors}}
    templates = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates"
    sync_request(api, "POST", templates, claim_template("big", {"requests": [big]}))
    pod = claim_pod("p", {"resourceClaimTemplateName": "big"})
    sync_request(api, "POST", f"/api/v1/namespaces/{namespace}/pods", pod)

    def bound() -> str | None:
        pod = sync_request(api, "GET", f"/api/v1/namespaces/{namespace}/pods/p")
        return pod["spec"].get("nodeName")

    assert wait_for("pod bound", bound, timeout=60) == node
    claims_path = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
    claims = sync_request(api, "GET", claims_path)["items"]
    assert len(claims) == 1, "the resourceclaim controller creates exactly one claim from the template"
    claim = claims[0]
    assert claim["metadata"]["name"].startswith("p-gpu-")
    results = claim["status"]["allocation"]["devices"]["results"]
    assert [(r["driver"], r["pool"], r["device"]) for r in results] == [(DRIVER, node, "large")]
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["p"]


def test_invalid_cel_is_rejected_naming_the_expression(api: client.ApiClient, unique: str) -> None:
    bad = 'device.driver == "x" &&& true'
    with pytest.raises(ApiException) as err:
        create_device_class(api, f"bad-{unique}", bad)
    assert err.value.status == 422
    body = err.value.body or ""
    assert "spec.selectors[0].cel.expression" in body
    assert "compilation failed" in body or "Syntax error" in body


def test_kubectl_lists_and_describes_slices(
    control_plane: ControlPlane, api: client.ApiClient, unique: str
) -> None:
    node = f"kubectl-{unique}"
    sync_request(api, "POST", "/apis/resource.k8s.io/v1/resourceslices", _slice(node, unique))
    out = control_plane.kubectl("get", "resourceslices", "-o", "wide").stdout
    assert f"{node}-{unique}" in out and DRIVER in out
    described = control_plane.kubectl("describe", "resourceslice", f"{node}-{unique}").stdout
    assert "large" in described and "80Gi" in described
    version = control_plane.kubectl("version", "--client").stdout
    assert "v1.37.2" in version


def test_no_process_survives_a_killed_launcher(control_plane: ControlPlane, tmp_path: Path) -> None:
    """A launcher killed with SIGKILL (an interrupted test run) takes its components with it."""
    script = (
        "import sys, pathlib\n"
        "from tests.harness.cluster import ControlPlane\n"
        f"cp = ControlPlane.start(work_dir=pathlib.Path({str(tmp_path / 'c')!r}),"
        f" bin_dir=pathlib.Path({str(control_plane.bin_dir)!r}))\n"
        "print(' '.join(str(p.pid) for p in cp.processes.values()), flush=True)\n"
        "import time; time.sleep(600)\n"  # not a wait: the launcher lives until the test kills it
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 4
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    def all_gone() -> bool:
        return not any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in pids)

    assert wait_for("components to die with the launcher", all_gone, timeout=15)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


def test_stop_leaves_no_process(control_plane: ControlPlane, tmp_path: Path) -> None:
    cp = ControlPlane.start(work_dir=tmp_path / "c2", bin_dir=control_plane.bin_dir)
    pids = [p.pid for p in cp.processes.values()]
    t0 = time.monotonic()
    cp.stop()
    assert time.monotonic() - t0 < 30
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
