"""Kubelet-plugin figures against a real control plane: start-to-registered, Prepare/Unprepare latency, RSS.

Method: one `dra-driver kubelet-plugin` subprocess for a simulated 16-GPU node (L4s, no
NVLink) with a driver root of ELF stand-ins, a real etcd/apiserver; claims are created
by the benchmark with an admin-written allocation (one GPU each), so the plugin does
its real work: a GET of the claim from the API server, the checkpoint, the CDI spec.
Its CDI and state dirs are on a tmpfs (/dev/shm), as /var/run/cdi and /run are on a node.
The calls come from `kubelet-client` (benchmarks/kubeletclient, grpc-go on one connection,
as the kubelet calls a plugin), which times each RPC on its side of the unix socket:
200 sequential calls per phase after 10 untimed ones; "concurrent" sends 16 claims as 16
simultaneous RPCs, 20 rounds. RSS is the plugin's VmRSS from /proc after those phases and
after 1000 more prepare/unprepare cycles of one claim. The plugin logs at `info`, the
chart's default. Start-to-registered runs from spawning the process to the registration
socket answering GetInfo.

The floor, measured in the same run on the same machine, so that figures from noisy
machines compare: `floor.get` a GET of the same claim on a keep-alive HTTPS connection
(http.client, no client library); `floor.durable_write` one 4 KiB write + fsync + rename
in the kubelet's plugin dir (on disk: what a durable checkpoint would cost there);
`floor.grpc_empty` an empty NodePrepareResources from kubelet-client to a minimal
grpc.aio server of the same proto in its own process. The floor of a Prepare is GET +
empty call + the durable writes it needs (none: see dra_driver.plugin.checkpoint); of an
Unprepare, the empty call. `ratios` divide each p50 by its floor; the concurrent figures
are also divided by the sequential p50, beside the same ratio of the empty call to the
minimal server (`floor_16_concurrent_to_sequential`) and of the API server's own GETs
(`get_go`, `get_go_16_concurrent`: kubelet-client GETs the same claims, one and 16 at
once, on keep-alive connections from Go; on a 2-core machine the API server and etcd
share the cores with the plugin, so 16 GETs at once take several times one GET).

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
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from benchmarks import fresh_control_plane, kubelet_client, report
from dra_driver.driver_root import COMPUTE_LIBRARIES, UTILITY_BINARIES
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
    """A driver root shaped like a real node's: every current compute library (real file,
    SONAME link) and the utility binaries, as ELF stand-ins; its CDI specs then carry as
    many mounts as the H200 host's (89: tests/hardware/RESULTS.md)."""
    (root / "lib64").mkdir(parents=True)
    (root / "bin").mkdir()
    for name in COMPUTE_LIBRARIES[:-2]:  # the last two are for drivers older than 525
        shutil.copy("/bin/true", root / "lib64" / f"{name}.570.124.06")
        (root / "lib64" / f"{name}.1").symlink_to(f"{name}.570.124.06")
    for name in UTILITY_BINARIES:
        shutil.copy("/bin/true", root / "bin" / name)
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


def _timings(call: Callable[[], object], n: int) -> list[float]:
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


def _floor_grpc(binary: Path, work: Path, rounds: int) -> dict[str, list[float]]:
    """Empty calls from kubelet-client to the minimal server: one at a time, and 16 at once
    (its own ratio shows what a grpc.aio server costs on this machine before the plugin
    does anything)."""
    socket = work / "floor.sock"
    server = subprocess.Popen(
        [sys.executable, "-c", f"from benchmarks.prepare import serve_empty; serve_empty({str(socket)!r})"]
    )
    try:
        return kubelet_client.run(binary, socket, [], rounds, max(rounds // 10, 5), only_empty=True)
    finally:
        server.kill()
        server.wait()


def _run_root() -> tuple[Path, str]:
    """Where the plugin's CDI specs and checkpoint go: a tmpfs, as /run is on a node."""
    shm = Path("/dev/shm")
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    kind = next((fields[2] for fields in mounts if fields[1] == str(shm)), "")
    if kind == "tmpfs":
        return Path(tempfile.mkdtemp(prefix="dra-bench-run-", dir=shm)), kind
    return Path(tempfile.mkdtemp(prefix="dra-bench-run-")), "not a tmpfs (no /dev/shm)"


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
        "plugin_empty_16_concurrent_to_sequential": ratio(
            result["plugin_empty_16_concurrent"]["p50_ms"], result["plugin_empty_call"]["p50_ms"]
        ),
        "floor_16_concurrent_to_sequential": ratio(
            floor["grpc_empty_16_concurrent"]["p50_ms"], floor["grpc_empty"]["p50_ms"]
        ),
        "get_16_concurrent_to_sequential": ratio(
            floor["get_go_16_concurrent"]["p50_ms"], floor["get_go"]["p50_ms"]
        ),
        "prepare_16_concurrent_to_get_16_concurrent": ratio(
            result["prepare_16_concurrent"]["p50_ms"], floor["get_go_16_concurrent"]["p50_ms"]
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

        run_root, run_fs = _run_root()
        plugin = DriverProcess(
            NODE,
            str(_profile(work / "bench16.yaml")),
            cp.kubeconfig,
            work / "p",
            extra_args=("--driver-root", str(_driver_root(work / "driver-root"))),
            log_level="info",  # as the chart runs it
            run_root=run_root,
        )
        binary = kubelet_client.build()
        t0 = time.perf_counter()
        plugin.start(wait=False)
        plugin.wait_serving(timeout=60)
        start_to_registered = time.perf_counter() - t0
        assert plugin.proc is not None
        try:
            kubelet = KubeletSide(plugin.registration_socket())  # registers, as the kubelet does
            refs = [(c.namespace, c.name, c.uid) for c in claims]
            socket = Path(kubelet.info.endpoint)
            token_file = work / "bench.token"
            token_file.write_text(ADMIN_TOKEN)
            api_server = kubelet_client.ApiServer(cp.server, cp.ca_file, token_file)
            phases = kubelet_client.run(binary, socket, refs, rounds, max(rounds // 10, 5), api=api_server)
            rss_before = _rss_kib(plugin.proc.pid)
            for _ in range(cycles):
                kubelet.prepare(claims[1])
                kubelet.unprepare(claims[1])
            rss_after = _rss_kib(plugin.proc.pid)
            kubelet.close()
        finally:
            plugin.stop()
            shutil.rmtree(run_root, ignore_errors=True)
        floor_calls = _floor_grpc(binary, work, rounds)
        floor = {
            "get": _percentiles(_floor_get(cp, f"{CLAIMS}/c0", rounds)),
            "durable_write": _percentiles(_floor_durable_write(plugin.data_dir, rounds)),
            "grpc_empty": _percentiles(floor_calls["empty"]),
            "grpc_empty_16_concurrent": _percentiles(floor_calls["empty_concurrent"]),
            "get_go": _percentiles(phases["get_sequential"]),
            "get_go_16_concurrent": _percentiles(phases["get_concurrent"]),
        }
        result = {
            "start_to_registered_s": round(start_to_registered, 3),
            "state_and_cdi_dirs": run_fs,
            "prepare_sequential": _percentiles(phases["prepare_sequential"]),
            "unprepare_sequential": _percentiles(phases["unprepare_sequential"]),
            "prepare_16_concurrent": _percentiles(phases["prepare_concurrent"]),
            "unprepare_16_concurrent": _percentiles(phases["unprepare_concurrent"]),
            "rss_kib_after_warmup": rss_before,
            f"rss_kib_after_{cycles}_cycles": rss_after,
            "rss_growth_kib": rss_after - rss_before,
            "plugin_empty_call": _percentiles(phases["empty"]),
            "plugin_empty_16_concurrent": _percentiles(phases["empty_concurrent"]),
            "floor": floor,
        }
        return {**result, "ratios": _ratios(result)}


def main() -> None:
    report("prepare", run())


if __name__ == "__main__":
    main()
