"""Kubelet-plugin figures against a real control plane: start-to-registered, Prepare/Unprepare latency, RSS.

Method: one `dra-driver kubelet-plugin` subprocess for a simulated 16-GPU node (L4s, no
NVLink) with a driver root of ELF stand-ins, a real etcd/apiserver; claims are created
by the benchmark with an admin-written allocation (one GPU each), so the plugin does
its real work: a GET of the claim from the API server, the two-phase checkpoint, the
CDI spec write. Latency is measured on the client side of the unix socket (the
kubelet's view), `time.perf_counter` around each RPC. "Concurrent" sends 16 claims as
16 simultaneous RPCs from 16 threads. RSS is the plugin's VmRSS from /proc after
warm-up and after 1000 prepare/unprepare cycles of one claim. The plugin logs at `info`,
the chart's default. Start-to-registered runs
from spawning the process to the registration socket answering GetInfo.

The floor, measured in the same run on the same machine, so that figures from noisy
machines compare: `floor.get` a GET of the same claim on a keep-alive HTTPS connection
(http.client, no client library); `floor.durable_write` one 4 KiB write + fsync +
rename in the plugin's data dir; `floor.grpc_empty` an empty NodePrepareResources on a
minimal grpc.aio server of the same proto in its own process. The floor of a Prepare is
GET + empty call + the durable writes it needs (none: see dra_driver.plugin.checkpoint);
of an Unprepare, the empty call. `ratios` divide each p50 by its floor; the concurrent
figures are also divided by the sequential p50, beside the same ratio of the empty call
(`floor.grpc_empty_16_concurrent`: 16 threads of a Python client on a small machine are
themselves several times slower than one).

Run alone: `python -m benchmarks.prepare` (prints JSON; writes benchmarks/results/prepare.json).
"""

from __future__ import annotations

import http.client
import os
import shutil
import ssl
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from benchmarks import fresh_control_plane, report
from dra_driver.kubeletapi.dra.v1 import api_pb2 as dra_v1
from dra_driver.kubeletapi.dra.v1 import api_pb2_grpc as dra_v1_grpc
from tests.harness.cluster import ADMIN_TOKEN, ControlPlane
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.kubelet import ClaimName, KubeletSide
from tests.harness.objects import create_node, sync_client, sync_request

NODE = "bench-node"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/bench/resourceclaims"
GPUS = 16


def _profile(path: Path) -> Path:
    gpus = [
        {
            "uuid": f"GPU-{i:08x}-0000-4000-8000-{i:012x}",
            "pci_bus_id": f"00000000:{i + 1:02X}:00.0",
            "pcie_root": f"pci0000:{i:02x}",
        }
        for i in range(GPUS)
    ]
    profile = {
        "description": f"{GPUS}x L4 (benchmark)",
        "driver": {"version": "570.124.06", "cuda_version": 12080},
        "gpu_defaults": {
            "name": "NVIDIA L4",
            "brand": "NVIDIA",
            "architecture": "ADA",
            "cuda_compute_capability": "8.9",
            "memory_bytes": 24152899584,
            "numa_node": 0,
            "errors": {"nvmlDeviceGetNvLinkState": "NOT_SUPPORTED", "nvmlDeviceGetMigMode": "NOT_SUPPORTED"},
        },
        "gpus": gpus,
    }
    path.write_text(yaml.safe_dump(profile))
    return path


def _driver_root(root: Path) -> Path:
    (root / "lib64").mkdir(parents=True)
    for name in ("libcuda.so", "libnvidia-ml.so"):
        shutil.copy("/bin/true", root / "lib64" / f"{name}.570.124.06")
        (root / "lib64" / f"{name}.1").symlink_to(f"{name}.570.124.06")
    return root


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 3),
        "max_ms": round(ordered[-1] * 1000, 3),
    }


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _timings(call: Any, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t)
    return samples


def _floor_get(cp: ControlPlane, path: str, n: int) -> list[float]:
    """A GET of `path` on one keep-alive HTTPS connection, no client library in between."""
    host, port = cp.server.removeprefix("https://").rsplit(":", 1)
    conn = http.client.HTTPSConnection(
        host, int(port), context=ssl.create_default_context(cafile=str(cp.ca_file))
    )
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Accept": "application/json"}

    def get() -> None:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        response.read()
        assert response.status == 200, response.status

    get()
    samples = _timings(get, n)
    conn.close()
    return samples


def _floor_durable_write(directory: Path, n: int) -> list[float]:
    """One 4 KiB file written, fsync'd and renamed into place, as a durable checkpoint write would be."""
    data, target, temp = os.urandom(4096), directory / "floor.json", directory / "floor.json.tmp"

    def write() -> None:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, target)

    samples = _timings(write, n)
    target.unlink()
    return samples


class _EmptyPlugin(dra_v1_grpc.DRAPluginServicer):
    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        return dra_v1.NodePrepareResourcesResponse()


def serve_empty(socket: str) -> None:
    """The gRPC floor's server: answers NodePrepareResources with nothing, as fast as grpc.aio can."""
    import asyncio

    import grpc

    async def serve() -> None:
        server = grpc.aio.server()
        dra_v1_grpc.add_DRAPluginServicer_to_server(_EmptyPlugin(), server)
        server.add_insecure_port(f"unix://{socket}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def _floor_grpc(work: Path, n: int) -> tuple[list[float], list[float]]:
    """Empty calls to the minimal server: one at a time, and 16 at once from 16 threads (the
    same client pattern as the concurrent figures, so its own ratio shows what the client
    and the two-core machine cost before the plugin does anything)."""
    import grpc

    socket = work / "floor.sock"
    server = subprocess.Popen(
        [sys.executable, "-c", f"from benchmarks.prepare import serve_empty; serve_empty({str(socket)!r})"]
    )
    try:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            stub = dra_v1_grpc.DRAPluginStub(channel)
            request = dra_v1.NodePrepareResourcesRequest()

            def call() -> None:
                stub.NodePrepareResources(request, timeout=10)

            call()
            sequential = _timings(call, n)
            concurrent: list[float] = []
            with ThreadPoolExecutor(GPUS) as pool:
                for _ in range(max(n // 10, 5)):
                    concurrent += [t[0] for t in pool.map(lambda _: _timings(call, 1), range(GPUS))]
            return sequential, concurrent
    finally:
        server.kill()
        server.wait()


def _ratios(result: dict[str, Any]) -> dict[str, float]:
    floor = result["floor"]
    prepare_floor = floor["get"]["p50_ms"] + floor["grpc_empty"]["p50_ms"]
    unprepare_floor = floor["grpc_empty"]["p50_ms"]

    def ratio(a: float, b: float) -> float:
        return round(a / b, 2)

    return {
        "prepare_floor_ms": round(prepare_floor, 3),
        "prepare_sequential_to_floor": ratio(result["prepare_sequential"]["p50_ms"], prepare_floor),
        "unprepare_sequential_to_floor": ratio(result["unprepare_sequential"]["p50_ms"], unprepare_floor),
        "prepare_16_concurrent_to_sequential": ratio(
            result["prepare_16_concurrent"]["p50_ms"], result["prepare_sequential"]["p50_ms"]
        ),
        "unprepare_16_concurrent_to_sequential": ratio(
            result["unprepare_16_concurrent"]["p50_ms"], result["unprepare_sequential"]["p50_ms"]
        ),
        "plugin_empty_call_to_floor": ratio(result["plugin_empty_call"]["p50_ms"], unprepare_floor),
        "floor_16_concurrent_to_sequential": ratio(
            floor["grpc_empty_16_concurrent"]["p50_ms"], floor["grpc_empty"]["p50_ms"]
        ),
    }


def run(cycles: int = 1000, rounds: int = 200) -> dict[str, Any]:
    with fresh_control_plane("dra-bench-") as (cp, work):
        api = sync_client(str(cp.kubeconfig))
        create_node(api, NODE)
        sync_request(
            api,
            "POST",
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench"}},
        )
        claims: list[ClaimName] = []
        for i in range(GPUS):
            claim = sync_request(
                api,
                "POST",
                "/apis/resource.k8s.io/v1/namespaces/bench/resourceclaims",
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {"name": f"c{i}"},
                    "spec": {
                        "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "any"}}]}
                    },
                },
            )
            claim["status"] = {
                "allocation": {
                    "devices": {
                        "results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": f"gpu-{i}"}]
                    }
                }
            }
            claim = sync_request(
                api, "PUT", f"/apis/resource.k8s.io/v1/namespaces/bench/resourceclaims/c{i}/status", claim
            )
            claims.append(ClaimName("bench", f"c{i}", claim["metadata"]["uid"]))

        plugin = DriverProcess(
            NODE,
            str(_profile(work / "bench16.yaml")),
            cp.kubeconfig,
            work / "p",
            extra_args=("--driver-root", str(_driver_root(work / "driver-root"))),
            log_level="info",  # as the chart runs it
        )
        t0 = time.perf_counter()
        plugin.start(wait=False)
        plugin.wait_serving(timeout=60)
        start_to_registered = time.perf_counter() - t0
        assert plugin.proc is not None
        kubelet = KubeletSide(plugin.registration_socket())

        def timed(call: Any, *args: ClaimName) -> float:
            t = time.perf_counter()
            response = call(*args)
            elapsed = time.perf_counter() - t
            errors = [r.error for r in response.claims.values() if r.error]
            assert not errors, errors
            return elapsed

        empty_call = _timings(lambda: kubelet.prepare(), rounds)
        seq_prepare, seq_unprepare = [], []
        for _ in range(rounds):
            seq_prepare.append(timed(kubelet.prepare, claims[0]))
            seq_unprepare.append(timed(kubelet.unprepare, claims[0]))

        conc_prepare, conc_unprepare = [], []
        with ThreadPoolExecutor(GPUS) as pool:
            for _ in range(max(rounds // 10, 5)):
                conc_prepare += list(pool.map(lambda c: timed(kubelet.prepare, c), claims))
                conc_unprepare += list(pool.map(lambda c: timed(kubelet.unprepare, c), claims))

        rss_before = _rss_kib(plugin.proc.pid)
        for _ in range(cycles):
            kubelet.prepare(claims[1])
            kubelet.unprepare(claims[1])
        rss_after = _rss_kib(plugin.proc.pid)
        kubelet.close()
        plugin.stop()
        floor = {
            "get": _percentiles(_floor_get(cp, f"{CLAIMS}/c0", rounds)),
            "durable_write": _percentiles(_floor_durable_write(plugin.data_dir, rounds)),
        }
        grpc_sequential, grpc_concurrent = _floor_grpc(work, rounds)
        floor["grpc_empty"] = _percentiles(grpc_sequential)
        floor["grpc_empty_16_concurrent"] = _percentiles(grpc_concurrent)
        result = {
            "start_to_registered_s": round(start_to_registered, 3),
            "prepare_sequential": _percentiles(seq_prepare),
            "unprepare_sequential": _percentiles(seq_unprepare),
            "prepare_16_concurrent": _percentiles(conc_prepare),
            "unprepare_16_concurrent": _percentiles(conc_unprepare),
            "rss_kib_after_warmup": rss_before,
            f"rss_kib_after_{cycles}_cycles": rss_after,
            "rss_growth_kib": rss_after - rss_before,
            "plugin_empty_call": _percentiles(empty_call),
            "floor": floor,
        }
        return {**result, "ratios": _ratios(result)}


def main() -> None:
    report("prepare", run())


if __name__ == "__main__":
    main()
