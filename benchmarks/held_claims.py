"""Prepare's cost as the claims a node holds grow: one claim's NodePrepareResources with 0,
100, 250 and 500 other claims prepared on the node.

Method: a real etcd/apiserver and one `dra-driver kubelet-plugin` subprocess for a
simulated 4-GPU node (`l4x4`), as benchmarks/huge_prepare.py: claims allocated by hand, all
on gpu-0 with adminAccess, so each is really prepared (an API read, a CDI spec, a checkpoint
entry). At each level the node is brought to that many held claims (one call), then
ROUNDS claims are prepared one call each, sequentially, from the kubelet's side of the
socket, timed around the RPC, and unprepared again (so the level stays). What grows with
the claims held is the checkpoint: every Prepare reads it and writes it whole.

Run alone: `python -m benchmarks.held_claims` (prints JSON; writes
benchmarks/results/held_claims.json). About a minute on 2 cores.
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks import fresh_control_plane, report
from benchmarks.huge_prepare import NAMESPACE, NODE, admin_claim
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.kubelet import KubeletSide
from tests.harness.objects import create_device_class, create_node, sync_client, sync_request

LEVELS = (0, 100, 250, 500)
ROUNDS = 30


def run() -> dict[str, Any]:
    with fresh_control_plane("held-") as (cp, work):
        api = sync_client(str(cp.kubeconfig))
        create_node(api, NODE)
        create_device_class(api, NODE, f'device.driver == "{DRIVER}"')
        sync_request(api, "POST", "/api/v1/namespaces", {
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": NAMESPACE, "labels": {"resource.kubernetes.io/admin-access": "true"}}})
        with ThreadPoolExecutor(8) as pool:
            held = list(pool.map(lambda i: admin_claim(api, i), range(max(LEVELS))))
            timed = list(pool.map(lambda i: admin_claim(api, i), range(max(LEVELS), max(LEVELS) + ROUNDS)))
        plugin = DriverProcess(NODE, "l4x4", cp.kubeconfig, work / "node",
                               extra_args=("--no-publish-slices",))
        plugin.start()
        try:
            kubelet = KubeletSide(plugin.registration_socket(), timeout=120)
            levels = []
            now = 0
            for level in LEVELS:
                if level > now:
                    answer = kubelet.prepare(*held[now:level])
                    assert not any(c.error for c in answer.claims.values())
                    now = level
                times = []
                for ref in timed:
                    t = time.perf_counter()
                    answer = kubelet.prepare(ref)
                    times.append((time.perf_counter() - t) * 1000)
                    assert not answer.claims[ref.uid].error, answer.claims[ref.uid].error
                kubelet.unprepare(*timed)
                times.sort()
                levels.append({"held": level, "prepare_ms_p50": round(statistics.median(times), 2),
                               "prepare_ms_p90": round(times[int(len(times) * 0.9)], 2)})
                print(f"[bench] {level} held: p50 {levels[-1]['prepare_ms_p50']} ms", file=sys.stderr)
            kubelet.close()
        finally:
            plugin.stop()
    return {"rounds": ROUNDS, "levels": levels}


def main() -> None:
    report("held_claims", run())


if __name__ == "__main__":
    main()
