"""What the ComputeDomain controller costs the cluster: API writes and CPU per domain, and the
time from a burst of domains to every domain's template and status.

Method: a fresh control plane (tests/harness/cluster.py), the CRD as the chart renders it, and
`dra-driver compute-domain-controller` as a process of its own. N domains (default 100) are
created at once (16 in flight) across R namespaces (default 20, one per rack: a job's domain
lives in its job's namespace), each naming its own template, with numNodes 4. Figures:
- `templates_s`: from the first creation to the last domain's ResourceClaimTemplate present,
  `status_s` to the last domain's status.status written (polled every 0.2 s with LISTs);
- `writes_per_domain`: the API server's own count of the controller's writes
  (`apiserver_request_total` for resourceclaimtemplates POST, computedomains PATCH, events
  POST) during the burst, per domain: one template and one status write is the floor;
- `cpu_ms_per_domain`: the controller's utime+stime from /proc over the burst, per domain;
  `idle_cpu_ms_per_s`: its CPU per second over `--idle` seconds afterwards, with every domain
  settled (what it costs a cluster that does not change);
- `rss_mib`: its resident memory at the end.
The node half (channels, IMEX daemons) is not in this figure: docs/compute-domains.md.
`python -m benchmarks.compute_domains [--domains N] [--namespaces R] [--idle S]` writes
benchmarks/results/compute_domains.json.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import fresh_control_plane, report
from benchmarks.health_storm import cpu_seconds
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER
from tests.harness.driver_image import render_chart
from tests.harness.objects import create_namespace, sync_client, sync_request, wait_for

CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
DOMAINS = f"/apis/{DRIVER}/v1beta1/computedomains"
_WRITE = re.compile(
    r'^apiserver_request_total\{(?=[^}]*resource="(resourceclaimtemplates|computedomains|events)")'
    r'(?=[^}]*verb="(POST|PATCH|PUT|DELETE)")[^}]*\}\s+(\S+)$'
)


def writes(cp: ControlPlane) -> dict[str, int]:
    """Writes the API server answered so far, by `resource verb`."""
    status, text = cp.get("/metrics", timeout=30)
    assert status == 200, text[:300]
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = _WRITE.match(line)
        if m:
            key = f"{m.group(1)} {m.group(2)}"
            counts[key] = counts.get(key, 0.0) + float(m.group(3))
    return {k: int(v) for k, v in counts.items()}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def run(domains: int, namespaces: int, idle: float) -> dict[str, Any]:
    with fresh_control_plane("cd-bench-") as (cp, work):
        api = sync_client(str(cp.kubeconfig))
        (crd,) = render_chart(work / "helm", "computeDomains.enabled=true",
                              show_only="templates/computedomain-crd.yaml")
        sync_request(api, "POST", CRDS, crd)
        wait_for("ComputeDomains served", lambda: sync_request(api, "GET", DOMAINS) is not None)
        for r in range(namespaces):
            create_namespace(api, f"rack-{r:02d}")
        proc = subprocess.Popen(
            [sys.executable, "-m", "dra_driver", "--log-level", "warning", "compute-domain-controller",
             "--driver-name", DRIVER, "--kubeconfig", str(cp.kubeconfig)],
        )
        try:
            time.sleep(3)  # listed and watching: its start is not the figure
            cpu0, writes0, t0 = cpu_seconds(proc.pid), writes(cp), time.monotonic()

            def create(i: int) -> None:
                ns = f"rack-{i % namespaces:02d}"
                body = {"apiVersion": f"{DRIVER}/v1beta1", "kind": "ComputeDomain",
                        "metadata": {"name": f"job-{i:04d}"},
                        "spec": {"numNodes": 4,
                                 "channel": {"resourceClaimTemplate": {"name": f"job-{i:04d}"}}}}
                sync_request(api, "POST", f"/apis/{DRIVER}/v1beta1/namespaces/{ns}/computedomains", body)

            with ThreadPoolExecutor(16) as pool:
                list(pool.map(create, range(domains)))
            created_s = time.monotonic() - t0
            wait_for("every template", lambda: len(sync_request(
                api, "GET", "/apis/resource.k8s.io/v1/resourceclaimtemplates")["items"]) >= domains,
                timeout=600, interval=0.2)
            templates_s = time.monotonic() - t0
            wait_for("every status", lambda: all(
                (d.get("status") or {}).get("status") for d in sync_request(api, "GET", DOMAINS)["items"]
            ), timeout=600, interval=0.2)
            status_s = time.monotonic() - t0
            time.sleep(1)  # writes in flight answered
            cpu1, writes1 = cpu_seconds(proc.pid), writes(cp)
            time.sleep(idle)
            cpu2 = cpu_seconds(proc.pid)
            made = {k: v - writes0.get(k, 0) for k, v in writes1.items() if v - writes0.get(k, 0)}
            by_controller = sum(v for k, v in made.items() if k != "computedomains POST")
            return {
                "domains": domains,
                "namespaces": namespaces,
                "create_s": round(created_s, 2),
                "templates_s": round(templates_s, 2),
                "status_s": round(status_s, 2),
                "writes": made,
                "writes_per_domain": round(by_controller / domains, 2),
                "cpu_ms_per_domain": round((cpu1 - cpu0) * 1000 / domains, 2),
                "idle_cpu_ms_per_s": round((cpu2 - cpu1) * 1000 / idle, 2),
                "rss_mib": rss_mib(proc.pid),
            }
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domains", type=int, default=100)
    parser.add_argument("--namespaces", type=int, default=20)
    parser.add_argument("--idle", type=float, default=10.0)
    args = parser.parse_args()
    report("compute_domains", run(args.domains, args.namespaces, args.idle))


if __name__ == "__main__":
    main()
