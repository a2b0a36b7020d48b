"""One NodePrepareResources call with 10,000 claims: time to answer and the plugin's memory.

Method: a real etcd/apiserver and one `dra-driver kubelet-plugin` subprocess for a
simulated 4-GPU node (`l4x4`). The benchmark creates N claims whose allocation it writes by
hand, all on gpu-0 with adminAccess (so every claim is really prepared: an API read, a
CDI spec, a checkpoint entry), in a namespace labelled for admin access. It then sends ONE
NodePrepareResources with all N claims from the kubelet's side of the socket, and one
NodeUnprepareResources with all N. Memory is the plugin's VmRSS from /proc before, right
after each call, and its peak (VmHWM); time is measured around each RPC on the client side.

What bounds the memory: claims are read and prepared in chunks (`state.CHUNK` claims per
transaction, at most 16 API reads in flight), so only one chunk's claim objects are alive
at a time; what grows with N is the checkpoint (one entry per claim) and the gRPC answer.

Run alone: `python -m benchmarks.huge_prepare [N]` (prints JSON; writes
benchmarks/results/huge_prepare.json). N=10000 takes about N/100 s for set-up on 2 cores.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import fresh_control_plane, report
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.kubelet import ClaimName, KubeletSide
from tests.harness.objects import create_device_class, create_node, sync_client, sync_request

NODE = "huge-node"
NAMESPACE = "huge"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/huge/resourceclaims"


def _memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def admin_claim(api: Any, i: int) -> ClaimName:
    name = f"c{i:05d}"
    request = {"name": "gpu", "exactly": {"deviceClassName": NODE, "adminAccess": True}}
    claim = sync_request(
        api,
        "POST",
        CLAIMS,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [request]}},
        },
    )
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0", "adminAccess": True}
    claim["status"] = {"allocation": {"devices": {"results": [result]}}}
    sync_request(api, "PUT", f"{CLAIMS}/{name}/status", claim)
    return ClaimName(NAMESPACE, name, claim["metadata"]["uid"])


def run(count: int = 10_000) -> dict[str, Any]:
    with fresh_control_plane("huge-") as (cp, work):
        return _measure(cp, work, count)


def _measure(cp: ControlPlane, work: Path, count: int) -> dict[str, Any]:
    plugin: DriverProcess | None = None
    try:
        api = sync_client(str(cp.kubeconfig))
        create_node(api, NODE)
        create_device_class(api, NODE, f'device.driver == "{DRIVER}"')
        sync_request(
            api,
            "POST",
            "/api/v1/namespaces",
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": NAMESPACE, "labels": {"resource.kubernetes.io/admin-access": "true"}},
            },
        )
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            refs = list(pool.map(lambda i: admin_claim(api, i), range(count)))
        print(f"[bench] {count} claims created in {time.monotonic() - t0:.0f}s", file=sys.stderr)
        plugin = DriverProcess(
            NODE, "l4x4", cp.kubeconfig, work / "node", extra_args=("--no-publish-slices",)
        )
        plugin.start()
        kubelet = KubeletSide(plugin.registration_socket(), timeout=600)
        before = _memory_kib(plugin.pid)
        t = time.perf_counter()
        answer = kubelet.prepare(*refs)
        prepare_s = time.perf_counter() - t
        errors = [c.error for c in answer.claims.values() if c.error]
        after_prepare = _memory_kib(plugin.pid)
        specs = len(list(plugin.cdi_dir.glob("*.json")))
        del answer
        t = time.perf_counter()
        unanswer = kubelet.unprepare(*refs)
        unprepare_s = time.perf_counter() - t
        unerrors = [c.error for c in unanswer.claims.values() if c.error]
        after_unprepare = _memory_kib(plugin.pid)
        kubelet.close()
        return {
            "claims": count,
            "prepare_seconds": round(prepare_s, 2),
            "prepare_errors": len(errors),
            "first_error": errors[0] if errors else None,
            "cdi_specs_after_prepare": specs,
            "unprepare_seconds": round(unprepare_s, 2),
            "unprepare_errors": len(unerrors),
            "rss_kib_before": before["VmRSS"],
            "rss_kib_after_prepare": after_prepare["VmRSS"],
            "rss_kib_after_unprepare": after_unprepare["VmRSS"],
            "peak_rss_kib": after_unprepare["VmHWM"],
        }
    finally:
        if plugin is not None:
            plugin.stop()


def main() -> None:
    report("huge_prepare", run(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000))


if __name__ == "__main__":
    main()
