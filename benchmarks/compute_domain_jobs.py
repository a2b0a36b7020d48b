"""What a ComputeDomain job waits for on the nodes: from the domain's creation to every one of
its pods' channel Prepares answered, and what those Prepares cost the plugin.

Method: a fresh control plane (tests/harness/cluster.py), the CRD, the channel class and
`dra-driver compute-domain-controller` as the chart ships them, and `--nodes` simulated GB200
trays in cliques of `--per-clique` (default 8 nodes, two cliques of 4), each a
`dra-driver kubelet-plugin --compute-domains` process with the stand-in IMEX tools
(tests/harness/fake_imex.py, ready at once) and the kubelet's side of the gRPC. `--jobs` jobs
(default 10), one after the other, each a domain with numNodes = `--per-clique` and one pod per
node of one clique (alternating), its pods pinned to those nodes. For each job:
- `template_s`: domain created -> its ResourceClaimTemplate present;
- `allocated_s`: -> every pod's channel claim allocated by the real scheduler;
- `prepared_s`: -> every node's channel Prepare answered (sent at once, as kubelets would once
  the pods are bound; each waits in the plugin until the whole domain is ready). There is no
  kubelet here: pod start through a real kubelet adds its own sync and container start
  (tests/node/test_compute_domains.py runs that path, untimed);
- the plugins' CPU (utime+stime from /proc) per channel Prepare and per Unprepare (which stops
  the domain's daemon and leaves the domain's status).
Then the pods are unprepared and deleted and the domain deleted before the next job.
`python -m benchmarks.compute_domain_jobs [--nodes N] [--per-clique K] [--jobs J]` writes
benchmarks/results/compute_domain_jobs.json.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import fresh_control_plane, report
from benchmarks.health_storm import cpu_seconds
from tests.harness.compute_domains import (
    channel_published,
    clique_profile,
    compute_domain_controller,
    domain,
    domains_path,
    exists,
    prepare_all,
)
from tests.harness.driver import DRIVER
from tests.harness.fake_imex import install_fake_imex
from tests.harness.kubelet import ClaimName, claim_ref
from tests.harness.objects import create_namespace, get_claim, get_pod, sync_client, sync_request, wait_for
from tests.harness.plugin_node import PluginNode, plugin_node

NS = "jobs"


def _claim_of(api: Any, pod: str) -> ClaimName | None:
    p = get_pod(api, NS, pod)
    statuses = (p.get("status") or {}).get("resourceClaimStatuses") or []
    if not statuses or not statuses[0].get("resourceClaimName"):
        return None
    claim = get_claim(api, NS, statuses[0]["resourceClaimName"])
    return claim_ref(claim) if (claim.get("status") or {}).get("allocation") else None


def _pod(name: str, node: str, template: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "automountServiceAccountToken": False,
                     "resourceClaims": [{"name": "channel", "resourceClaimTemplateName": template}],
                     "containers": [{"name": "main", "image": "busybox:1.37",
                                     "resources": {"claims": [{"name": "channel"}]}}]}}


def run(nodes: int, per_clique: int, jobs: int) -> dict[str, Any]:
    with fresh_control_plane("cd-jobs-") as (cp, _), contextlib.ExitStack() as stack:
        api = sync_client(str(cp.kubeconfig))
        stack.enter_context(compute_domain_controller(cp, api))
        create_namespace(api, NS)
        plugins: dict[str, PluginNode] = {}
        cliques: list[list[str]] = []
        for n in range(nodes):
            clique = n // per_clique
            if clique == len(cliques):
                cliques.append([])
            name = f"tray-{clique}-{n % per_clique}"
            root = Path(f"/tmp/cdj-{n}")
            root.mkdir(parents=True, exist_ok=True)
            profile = clique_profile(root / "profile.yaml", 100 + clique)
            install_fake_imex(root / "driver")
            args = ["--compute-domains", "--imex-root", str(root / "imex"),
                    "--node-ip", f"10.8.{clique}.{n + 1}", "--driver-root", str(root / "driver")]
            plugins[name] = stack.enter_context(plugin_node(
                api, cp.kubeconfig, name, str(profile), root / "node", args,
                published=lambda n=name: channel_published(api, n),
            ))
            cliques[-1].append(name)
        timings: dict[str, list[float]] = {"template_s": [], "allocated_s": [], "prepared_s": []}
        prepare_cpu: list[float] = []  # per job: the plugins' CPU over its Prepares, per Prepare
        unprepare_cpu = 0.0  # all jobs: /proc's 10 ms ticks are coarser than one Unprepare
        for j in range(jobs):
            members = cliques[j % len(cliques)]
            name = f"job-{j:03d}"
            t0 = time.monotonic()
            sync_request(api, "POST", domains_path(DRIVER, NS),
                         domain(name, name, numNodes=len(members)))
            wait_for("the template", lambda n=name: exists(
                api, f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates/{n}"), interval=0.02)
            timings["template_s"].append(time.monotonic() - t0)
            for node in members:
                sync_request(api, "POST", f"/api/v1/namespaces/{NS}/pods", _pod(f"{name}-{node}", node, name))
            claims = {node: wait_for("the claim", lambda p=f"{name}-{node}": _claim_of(api, p), interval=0.02)
                      for node in members}
            timings["allocated_s"].append(time.monotonic() - t0)
            cpu0 = sum(cpu_seconds(plugins[n].plugin.pid) for n in members)
            answers = prepare_all({n: plugins[n].side for n in members}, claims)
            timings["prepared_s"].append(time.monotonic() - t0)
            assert all(ids and not error for ids, error in answers), answers
            cpu1 = sum(cpu_seconds(plugins[n].plugin.pid) for n in members)
            for node in members:
                result = plugins[node].side.unprepare(claims[node]).claims[claims[node].uid]
                assert not result.error, result.error
            cpu2 = sum(cpu_seconds(plugins[n].plugin.pid) for n in members)
            prepare_cpu.append((cpu1 - cpu0) / len(members))
            unprepare_cpu += cpu2 - cpu1
            # no kubelet confirms a pod's end here: deleted at once, as after the kubelet's Unprepare
            sync_request(api, "DELETE", f"/api/v1/namespaces/{NS}/pods", query={"gracePeriodSeconds": "0"})
            sync_request(api, "DELETE", f"{domains_path(DRIVER, NS)}/{name}")
            wait_for("the claims gone", lambda: not sync_request(
                api, "GET", f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims")["items"], timeout=120)

        def summary(values: list[float], scale: float = 1.0) -> dict[str, float]:
            return {"p50": round(statistics.median(values) * scale, 3), "max": round(max(values) * scale, 3)}

        return {
            "nodes": nodes, "per_clique": per_clique, "jobs": jobs,
            **{k: summary(v) for k, v in timings.items()},
            "plugin_cpu_ms_per_channel_prepare": summary(prepare_cpu, 1000),
            "plugin_cpu_ms_per_channel_unprepare": round(unprepare_cpu * 1000 / (jobs * per_clique), 2),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--per-clique", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=10)
    args = parser.parse_args()
    report("compute_domain_jobs", run(args.nodes, args.per_clique, args.jobs))


if __name__ == "__main__":
    main()
