"""Who holds which GPU, under a real kubelet: a running pod's claim carries `status.devices`
with the UUID its CDI spec hands the container, the real `kubectl describe resourceclaim`
shows it, a fatal XID turns the device's Ready condition False and recovery back to True,
`kubectl gpu <node>` (the real kubectl finding the plugin on PATH) shows the pod on its GPU,
and the `gpu_dra_device_claim_info` series is on the plugin's /metrics while the pod runs and
gone after it. An unknown node is a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.harness.cluster import free_port
from tests.harness.node import Node
from tests.harness.objects import get_claim, get_pod
from tests.node import pods
from tests.node.conftest import NodeCluster
from tests.node.test_health import NODE, QUIET, allocated_gpu, h200, inject, restart_with, start_pod, wait_for

__all__ = ["h200"]  # the fixture, imported for the tests below

KUBECTL_GPU = Path(sys.executable).parent / "kubectl-gpu"


def ready(cluster: NodeCluster, namespace: str, claim: str) -> list[tuple[str, str, str]]:
    status = get_claim(cluster.api, namespace, claim).get("status", {})
    return [(d["device"], c["status"], c.get("message", "")) for d in status.get("devices") or []
            for c in d.get("conditions") or [] if c["type"] == "Ready"]


def info_series(port: int) -> list[dict[str, str]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return [s.labels for f in text_string_to_metric_families(text) if f.name == "gpu_dra_device_claim_info"
            for s in f.samples]


def kubectl_gpu(cluster: NodeCluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{KUBECTL_GPU.parent}:{os.environ.get('PATH', '')}",
           "KUBECONFIG": str(cluster.cp.kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return subprocess.run([str(cluster.cp.bin_dir / "kubectl"), "gpu", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_running_pod_claim_status_describe_xid_and_kubectl_gpu(
    cluster: NodeCluster, namespace: str, h200: Node
) -> None:
    port = free_port()
    restart_with(h200, "--health-quiet-period", str(QUIET), "--metrics-port", str(port),
                 "--metrics-bind-address", "127.0.0.1", "--claim-identity-metric")
    start_pod(cluster, namespace, "holder")
    pods.wait_running(cluster.api, namespace, "holder")
    device, index, uuid = allocated_gpu(cluster, namespace, "holder")
    claim = get_claim(cluster.api, namespace, "holder-gpu")
    [spec] = pods.cdi_specs_of(h200, claim["metadata"]["uid"])
    spec_uuids = {e.split("=", 1)[1] for d in json.loads(spec.read_text())["devices"]
                  for e in d.get("containerEdits", {}).get("env", []) if "=GPU-" in e}
    assert spec_uuids == {uuid}

    driver_log = h200.driver.log_tail if h200.driver else (lambda *_: "")
    wait_for("Ready in the claim's status.devices",
             lambda: ready(cluster, namespace, "holder-gpu") or None, 30, driver_log)
    [entry] = get_claim(cluster.api, namespace, "holder-gpu")["status"]["devices"]
    assert (entry["device"], entry["data"]["uuid"]) == (device, uuid)
    described = cluster.cp.kubectl("describe", "resourceclaim", "-n", namespace, "holder-gpu").stdout
    print(f"\n{described}")
    assert uuid in described and "Ready" in described

    series = wait_for("the info series", lambda: info_series(port) or None, 15)
    assert [(s["device"], s["uuid"], s["pod_namespace"], s["pod_name"]) for s in series] == [
        (device, uuid, namespace, "holder")]

    shown = kubectl_gpu(cluster, NODE)
    print(shown.stdout, shown.stderr)
    assert shown.returncode == 0, shown.stderr
    [row] = [line for line in shown.stdout.splitlines() if line.startswith(f"{device} ")
             and f"{namespace}/holder-gpu" in line]
    assert f"{namespace}/holder (Running)" in row and uuid in row
    as_json = json.loads(kubectl_gpu(cluster, NODE, "-o", "json").stdout)
    holders = [h for g in as_json["gpus"] for d in g["devices"] if d["name"] == device for h in d["holders"]]
    assert [h["claim_name"] for h in holders] == ["holder-gpu"]

    inject(h200, gpu=index, xid=79, recovery_action=1)
    sick = wait_for("Ready False after the XID",
                    lambda: [r for r in ready(cluster, namespace, "holder-gpu") if r[1] == "False"] or None,
                    30, driver_log)
    assert "79" in sick[0][2], sick
    inject(h200, gpu=index, recover=True)
    wait_for("Ready True after recovery",
             lambda: [r for r in ready(cluster, namespace, "holder-gpu") if r[1] == "True"] or None, 30,
             driver_log)
    assert get_pod(cluster.api, namespace, "holder")["status"]["phase"] == "Running"

    pods.delete_pod(cluster.api, namespace, "holder")
    pods.wait_gone(cluster.api, namespace, "holder")
    wait_for("the info series gone", lambda: not info_series(port) or None, 30)


def test_kubectl_gpu_unknown_node_is_a_clear_error(cluster: NodeCluster) -> None:
    shown = kubectl_gpu(cluster, "no-such-node")
    assert shown.returncode != 0
    assert "node 'no-such-node' does not exist" in shown.stderr and NODE in shown.stderr, shown.stderr
