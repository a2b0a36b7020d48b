"""Kubelet-plugin figures against a real control plane: start-to-registered, Prepare/Unprepare latency, RSS.

Method: one `dra-driver kubelet-plugin` subprocess for a simulated 16-GPU node (L4s, no
NVLink) with a driver root of ELF stand-ins, a real etcd/apiserver; claims are created
by the benchmark with an admin-written allocation (one GPU each), so the plugin does
its real work: a GET of the claim from the API server, the checkpoint, the CDI spec.
Its CDI and state dirs are on a tmpfs (/dev/shm), as /var/run/cdi and /run are on a node.
The calls come from `kubelet-client` (benchmarks/kubeletclient, grpc-go on one connection,
as the kubelet calls a plugin), which times each RPC on its side of the unix socket:
200 sequential calls per phase after 10 untimed ones; "concurrent" sends 16 claims as 16
simultaneous RPCs, 20 rounds. RSS is the plugin's VmRSS from /proc after those phases (and a
GET of /readyz, /livez and /metrics) and after 1000 more prepare/unprepare cycles of one
claim. The plugin runs as the chart runs it: its metrics port served (on 127.0.0.1), the
chart's MALLOC_ARENA_MAX, logging at `info`. Start-to-registered runs from spawning the
process to the registration socket answering GetInfo.

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

Beside an older commit (`--baseline-ref REF`): that commit is checked out once in a git
worktree, /tmp/bench-baseline-<sha12> (reused while it exists), and its plugin runs with the
same interpreter and .venv, `PYTHONPATH` at the worktree and `PYTHONSAFEPATH=1`, so that its
own `dra_driver` and `controller` are imported; before anything is timed, every module of
each side is imported once with that environment (a missing package, such as `hpack` for
code that still has its own HTTP/2 server, is named then) and byte-compiled. Both sides then
share one control plane, one set of claims and one kubelet-client, and run in alternation,
B C C B for `--starts 2` (the default with a baseline; B C C B B C ... for more), so that
drift on the machine hits both alike: each start is a fresh plugin process with fresh
kubelet, CDI and state dirs, timed from spawn to registered, then `--rounds` sequential
calls per phase split among the starts of a side (the concurrent rounds likewise), then RSS,
`--cycles` cycles, RSS. Latencies are pooled per side; start-to-registered and RSS are the
median over its starts (each start's own in `per_start`). `current_to_baseline` divides
each figure of the current side by the baseline's (p50 and p99 of each phase; < 1 is
faster or smaller). The floor is measured once, after all starts. `--current-ref REF` puts
a commit instead of the working tree on the current side (to check the method with the
same code on both sides, or when the working tree's plugin does not start).

Beside dra-example-driver (`--example`): the baseline side is the example driver's kubelet
plugin, `sigs.k8s.io/dra-example-driver` at a pinned version (benchmarks.example_driver;
built by hack/bench/example-driver.sh from the Go module proxy, cached outside the
repository), on the same control plane, with claims of its own allocated to its driver
name, its plugin dir (checkpoint) and CDI dir on the same tmpfs, in the same alternation.
It does not write the claim's status; ours does (in the background).

Beside NVIDIA's own GPU plugin (`--nvidia`, with or without `--example`): a third side,
`nvidia`, cmd/gpu-kubelet-plugin of `sigs.k8s.io/dra-driver-nvidia-gpu` at a pinned version
(benchmarks.nvidia_driver, which says what it is given; built by hack/bench/nvidia-driver.sh,
cached outside the repository), in the same alternation (B C N, N C B, ...), on the same
control plane, kubelet-client and tmpfs. It needs NVML: on a GPU host it discovers the real
GPUs (all of its claims go to them, several claims to a GPU when there are fewer than 16,
which its ConsumableShares gate allows), where ours and the example run 16 simulated ones;
its claims are made once its first start has published its GPUs. `current_to_nvidia` divides
ours by it as `current_to_baseline` does by the baseline.

CPU: `start_cpu_s` is the plugin's CPU time from exec to registered; over the `--cycles`
Prepare/Unprepare cycles the plugin's CPU time is read before and after each call (the
kernel's CPU-time clock of the process, to the nanosecond: benchmarks.cpu_clock; results
before Dec 6 20:20 UTC read utime+stime, in 10 ms ticks, which overstate an idle process's
timer wakeups), and `cpu_ms_per_prepare` / `cpu_ms_per_unprepare` are the sums over the
calls of each kind divided by their count (`cpu_ms_per_cycle`, read once around all the
cycles, is the check). Work a plugin does in the background after answering
(ours: the claim's status write) is counted to whichever call is in flight then; back to
back, a claim is unprepared before its status write would start (the writer waits for a
quiet period after the kubelet's calls, and then has nothing to write), so these cycles
do not include it. `cpu_ms_per_paced_cycle` does: PACED_CYCLES cycles with PACE_S after
each call (a pod that lives a second: its status written and released), their CPU time
less what the process spends idle (`idle_cpu_ms_per_second`, read over IDLE_S without a call
just before) over the same time.

Run alone: `python -m benchmarks.prepare [--example | --baseline-ref REF] [--current-ref REF]
[--starts N] [--rounds N] [--cycles N] [--profile DIR]` (prints each start's progress and, with a baseline,
a table of both sides and their ratios on stderr; the figures as JSON on stdout; writes
benchmarks/results/prepare.json).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks import (
    cpu_clock,
    example_driver,
    fresh_control_plane,
    kubelet_client,
    nvidia_driver,
    plugin_profile,
    report,
)
from benchmarks.kubelet_client import REPO
from dra_driver.driver_root.user_space import COMPUTE_LIBRARIES, UTILITY_BINARIES
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


def _shm_is_tmpfs() -> bool:
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    return next((fields[2] for fields in mounts if fields[1] == "/dev/shm"), "") == "tmpfs"


def _run_root() -> tuple[Path, str]:
    """Where the plugin's CDI specs and checkpoint go: a tmpfs, as /run is on a node."""
    if _shm_is_tmpfs():
        return Path(tempfile.mkdtemp(prefix="dra-bench-run-", dir="/dev/shm")), "tmpfs"
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


def _cpu_s(pid: int) -> float:
    """CPU time of the process (all its threads, those ended included), in seconds, from the
    kernel's CPU-time clock (benchmarks.cpu_clock: to the nanosecond, not in ticks)."""
    return cpu_clock.process_cpu_ns(pid) / 1e9


def _claims(
    api: Any, driver: str = DRIVER, prefix: str = "c", devices: list[str] | None = None
) -> list[ClaimName]:
    """GPUS claims in namespace bench, each allocated one GPU of NODE of `driver` by an admin
    write: gpu-0, gpu-1, ... or, with `devices`, those in turn."""
    if prefix == "c":
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
            CLAIMS,
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": f"{prefix}{i}"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "any"}}]}},
            },
        )
        claim["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": driver,
                            "pool": NODE,
                            "device": devices[i % len(devices)] if devices else f"gpu-{i}",
                        }
                    ]
                }
            }
        }
        claim = sync_request(api, "PUT", f"{CLAIMS}/{prefix}{i}/status", claim)
        claims.append(ClaimName("bench", f"{prefix}{i}", claim["metadata"]["uid"]))
    return claims


@dataclass(frozen=True)
class Side:
    """One version of the plugin: `code` is put first on the plugin's PYTHONPATH (the
    checkout itself for the working tree, a git worktree for a commit); or, with
    `example`, dra-example-driver's kubelet plugin (that binary; `code` unused); or, with
    `nvidia`, NVIDIA's gpu-kubelet-plugin (that binary)."""

    label: str
    code: Path
    describe: str  # "<sha>" or "working tree at <sha> (...)"
    example: Path | None = None
    nvidia: Path | None = None

    @property
    def go(self) -> bool:
        return self.example is not None or self.nvidia is not None

    @property
    def env(self) -> dict[str, str]:
        # PYTHONSAFEPATH: `python -m dra_driver` would put the cwd first, ahead of PYTHONPATH.
        # What PYTHONPATH had stays after the code (the GPU host's carried packages).
        paths = [str(self.code), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        return {"PYTHONPATH": os.pathsep.join(paths), "PYTHONSAFEPATH": "1"}


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def working_tree_side(label: str = "current") -> Side:
    if not (REPO / ".git").exists():  # a copy without history, as on the GPU host
        return Side(label, REPO, "working tree (a copy without git history)")
    head = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", "dra_driver", "controller")
    changes = "with uncommitted changes in dra_driver/controller" if dirty else "clean"
    return Side(label, REPO, f"working tree at {head} ({changes})")


def commit_side(ref: str, label: str) -> Side:
    """`ref` checked out in a git worktree /tmp/bench-baseline-<sha12> (made once, reused)."""
    sha = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    path = Path(f"/tmp/bench-baseline-{sha[:12]}")
    if not (path / ".git").exists():
        if path.exists():
            raise RuntimeError(f"{path} exists but is not a git worktree: remove it")
        _git("worktree", "add", "--detach", str(path), sha)
    found = _git("rev-parse", "HEAD", cwd=path)
    if found != sha:
        raise RuntimeError(f"{path} is at {found}, not {sha}: `git worktree remove --force {path}`")
    return Side(label, path, sha)


_IMPORT_CHECK = """
import importlib, json, pkgutil
failed = {}
files = {}
for package in ("dra_driver", "controller"):
    module = importlib.import_module(package)
    files[package] = module.__file__
    for info in pkgutil.walk_packages(module.__path__, package + "."):
        if not info.name.endswith("__main__"):
            try:
                importlib.import_module(info.name)
            except Exception as e:
                failed[info.name] = repr(e)
print(json.dumps({"files": files, "failed": failed}))
"""


def example_side(label: str = "baseline") -> Side:
    binary = example_driver.build()
    version = os.environ.get("DRA_EXAMPLE_DRIVER_VERSION", example_driver.EXAMPLE_VERSION)
    return Side(label, REPO, f"dra-example-driver {version} (Go, from the Go module proxy)", binary)


def nvidia_side(label: str = "nvidia") -> Side:
    binary = nvidia_driver.build()
    return Side(label, REPO, nvidia_driver.describe(binary), nvidia=binary)


def check_imports(side: Side) -> None:
    """Every module of the side's dra_driver and controller imports with this interpreter,
    from the side's own code (not the checkout's); byte-compiled first, so that no start
    timed later compiles."""
    if side.go:
        return
    subprocess.run(
        [
            sys.executable,
            "-m",
            "compileall",
            "-q",
            str(side.code / "dra_driver"),
            str(side.code / "controller"),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK],
        env={**os.environ, **side.env},
        cwd=side.code,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{side.label}: import check failed:\n{done.stderr}")
    found = json.loads(done.stdout.splitlines()[-1])
    for package, file in found["files"].items():
        if not Path(file).resolve().is_relative_to(side.code.resolve()):
            raise RuntimeError(f"{side.label}: {package} imported from {file}, not from {side.code}")
    if found["failed"]:
        missing = "\n".join(f"  {m}: {e}" for m, e in sorted(found["failed"].items()))
        raise RuntimeError(
            f"{side.label} ({side.describe}) does not import with {sys.executable}:\n{missing}\n"
            "a third-party package missing can go into .venv (test-only: `.venv/bin/pip install hpack`);"
            " a module of its own missing means that code is mid-change"
        )


@dataclass
class Block:
    """What one plugin process (one start of one side) measured."""

    label: str
    start_to_registered_s: float
    phases: dict[str, list[float]]
    rss_kib_after_warmup: int
    rss_kib_after_cycles: int
    start_cpu_s: float = 0.0  # CPU time from exec to registered
    cycles_cpu_s: float = 0.0  # CPU time over the cycles
    prepare_cpu_s: float = 0.0  # ... over the cycles' Prepares alone (sampled around each call)
    unprepare_cpu_s: float = 0.0
    cycles: int = 0
    idle_cpu_s: float = 0.0  # CPU time over IDLE_S without a call
    paced_cpu_s: float = 0.0  # ... over PACED_CYCLES cycles with PACE_S after each call
    profile: dict[str, Any] | None = None  # with --profile: plugin_profile windows, after the figures


# A pod that lives a while: its claim's status is written (dra_driver.plugin.claim_status
# waits for a quiet period after the kubelet's calls, and a claim unprepared before its
# write is never written, as in the back-to-back cycles above).
PACED_CYCLES = 10
PACE_S = 0.5
IDLE_S = 5.0
# --profile: windows after every figure is taken (the profiler's own CPU does not touch them)
PROFILE_CYCLES = 500
PROFILE_IDLE_S = 20.0


def _charted_env() -> dict[str, str]:
    """What the chart's DaemonSet sets for the plugin."""
    return {"MALLOC_ARENA_MAX": "2"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


Plugin = DriverProcess | example_driver.ExampleProcess | nvidia_driver.NvidiaProcess


def start_timed(plugin: Plugin) -> tuple[float, int, float]:
    """Start `plugin` and wait until its registration socket answers: (seconds from spawn to
    registered, its pid, its CPU seconds by then)."""
    t0 = time.perf_counter()
    plugin.start(wait=False)
    plugin.wait_serving(timeout=60)
    seconds = time.perf_counter() - t0
    assert plugin.proc is not None
    return seconds, plugin.proc.pid, _cpu_s(plugin.proc.pid)


def measure_block(
    side: Side,
    index: int,
    cp: ControlPlane,
    work: Path,
    claims: list[ClaimName] | Callable[[], list[ClaimName]],
    binary: Path,
    rounds: int,
    cycles: int,
    profile_dir: Path | None = None,
) -> tuple[Block, Path]:
    """Start one plugin of `side` (fresh dirs), time it, stop it. Returns the block and its
    data dir. `claims` may be a function, called once the plugin is registered (NVIDIA's:
    claims of the GPUs it published). With `profile_dir` (our plugin only), PROFILE_CYCLES
    more cycles and PROFILE_IDLE_S idle are profiled after the figures are taken."""
    run_root, _ = _run_root()
    plugin: Plugin
    metrics_port = 0
    if side.nvidia is not None:
        plugin = nvidia_driver.NvidiaProcess(
            side.nvidia, NODE, cp.kubeconfig, work / f"p-{side.label}-{index}", run_root
        )
    elif side.example is not None:
        plugin = example_driver.ExampleProcess(
            side.example, NODE, cp.kubeconfig, work / f"p-{side.label}-{index}", run_root, GPUS
        )
    else:
        plugin = DriverProcess(
            NODE,
            str(_profile(work / "bench16.yaml")),
            cp.kubeconfig,
            work / f"p-{side.label}-{index}",
            extra_args=("--driver-root", str(work / "driver-root"), "--metrics-port",
                        str(metrics_port := _free_port()), "--metrics-bind-address", "127.0.0.1"),
            env=side.env | _charted_env(),
            log_level="info",  # as the chart runs it
            run_root=run_root,
        )
    try:
        start_to_registered, pid, start_cpu = start_timed(plugin)
        kubelet = KubeletSide(plugin.registration_socket())  # registers, as the kubelet does
        if callable(claims):
            claims = claims()
        refs = [(c.namespace, c.name, c.uid) for c in claims]
        token_file = work / "bench.token"
        token_file.write_text(ADMIN_TOKEN)
        api_server = kubelet_client.ApiServer(cp.server, cp.ca_file, token_file)
        phases = kubelet_client.run(
            binary, Path(kubelet.info.endpoint), refs, rounds, max(rounds // 10, 5), api=api_server
        )
        if metrics_port:  # the kubelet's probes and a scrape have been served, as in a pod
            for path in ("/readyz", "/livez", "/metrics"):
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}{path}", timeout=10) as answer:
                    answer.read()
        rss_before = _rss_kib(pid)
        prepare_cpu = unprepare_cpu = 0.0
        cycles_start = _cpu_s(pid)
        for _ in range(cycles):
            before = _cpu_s(pid)
            kubelet.prepare(claims[1])
            between = _cpu_s(pid)
            kubelet.unprepare(claims[1])
            after = _cpu_s(pid)
            prepare_cpu += between - before
            unprepare_cpu += after - between
        cycles_cpu = _cpu_s(pid) - cycles_start
        rss_after = _rss_kib(pid)
        idle_start = _cpu_s(pid)
        time.sleep(IDLE_S)
        idle_cpu = _cpu_s(pid) - idle_start
        paced_start = _cpu_s(pid)
        for _ in range(PACED_CYCLES):
            kubelet.prepare(claims[1])
            time.sleep(PACE_S)
            kubelet.unprepare(claims[1])
            time.sleep(PACE_S)
        paced_cpu = _cpu_s(pid) - paced_start
        profile = None
        if profile_dir is not None and not side.go:
            with plugin_profile.profiled(pid, f"cycles-{index}", profile_dir) as busy:
                for _ in range(PROFILE_CYCLES):
                    kubelet.prepare(claims[1])
                    kubelet.unprepare(claims[1])
            with plugin_profile.profiled(pid, f"idle-{index}", profile_dir) as idle:
                time.sleep(PROFILE_IDLE_S)
            profile = {f"{PROFILE_CYCLES}_cycles": busy.as_dict(),
                       f"idle_{PROFILE_IDLE_S:g}_s": idle.as_dict()}
        kubelet.close()
    finally:
        plugin.stop()
        shutil.rmtree(run_root, ignore_errors=True)
    block = Block(
        side.label, start_to_registered, phases, rss_before, rss_after,
        start_cpu, cycles_cpu, prepare_cpu, unprepare_cpu, cycles, idle_cpu, paced_cpu, profile,
    )
    # the floor's durable write goes into a dir on disk: the Go plugins' plugin dirs are on the tmpfs
    return block, plugin.kubelet_dir if side.go else plugin.data_dir


def _side_result(blocks: list[Block], cycles: int) -> dict[str, Any]:
    def pooled(phase: str) -> list[float]:
        return [t for b in blocks for t in b.phases[phase]]

    def middle(values: list[float]) -> float:
        return statistics.median(values)

    rss_before = round(middle([b.rss_kib_after_warmup for b in blocks]))
    rss_after = round(middle([b.rss_kib_after_cycles for b in blocks]))
    calls = sum(b.cycles for b in blocks) or 1

    def per_call_ms(total: float) -> float:
        return round(total / calls * 1000, 3)

    result: dict[str, Any] = {
        "start_to_registered_s": round(middle([b.start_to_registered_s for b in blocks]), 3),
        "start_cpu_s": round(middle([b.start_cpu_s for b in blocks]), 3),
        "cpu_ms_per_prepare": per_call_ms(sum(b.prepare_cpu_s for b in blocks)),
        "cpu_ms_per_unprepare": per_call_ms(sum(b.unprepare_cpu_s for b in blocks)),
        "cpu_ms_per_cycle": per_call_ms(sum(b.cycles_cpu_s for b in blocks)),
        "idle_cpu_ms_per_second": round(sum(b.idle_cpu_s for b in blocks) / (IDLE_S * len(blocks)) * 1000, 3),
        # the paced cycles' CPU less what the process spends idle over the same time
        "cpu_ms_per_paced_cycle": round(
            sum(b.paced_cpu_s - b.idle_cpu_s * (2 * PACE_S * PACED_CYCLES / IDLE_S) for b in blocks)
            / (PACED_CYCLES * len(blocks)) * 1000, 3),
        "prepare_sequential": _percentiles(pooled("prepare_sequential")),
        "unprepare_sequential": _percentiles(pooled("unprepare_sequential")),
        "prepare_16_concurrent": _percentiles(pooled("prepare_concurrent")),
        "unprepare_16_concurrent": _percentiles(pooled("unprepare_concurrent")),
        "rss_kib_after_warmup": rss_before,
        f"rss_kib_after_{cycles}_cycles": rss_after,
        "rss_growth_kib": rss_after - rss_before,
        "plugin_empty_call": _percentiles(pooled("empty")),
        "plugin_empty_16_concurrent": _percentiles(pooled("empty_concurrent")),
    }
    profiles = [b.profile for b in blocks if b.profile]
    if profiles:
        result["profile"] = profiles[0]
    if len(blocks) > 1:
        result["per_start"] = [
            {
                "start_to_registered_s": round(b.start_to_registered_s, 3),
                "start_cpu_s": round(b.start_cpu_s, 3),
                "rss_kib_after_warmup": b.rss_kib_after_warmup,
                f"rss_kib_after_{cycles}_cycles": b.rss_kib_after_cycles,
            }
            for b in blocks
        ]
    return result


# the latency phases a run with a baseline compares, side by side
COMPARED_PHASES = (
    "prepare_sequential",
    "unprepare_sequential",
    "prepare_16_concurrent",
    "unprepare_16_concurrent",
    "plugin_empty_call",
    "plugin_empty_16_concurrent",
)

def _current_to_baseline(current: dict[str, Any], baseline: dict[str, Any], cycles: int) -> dict[str, float]:
    def ratio(a: float, b: float) -> float:
        return round(a / b, 2) if b else float("nan")

    out: dict[str, float] = {
        "start_to_registered": ratio(current["start_to_registered_s"], baseline["start_to_registered_s"]),
        "start_cpu": ratio(current["start_cpu_s"], baseline["start_cpu_s"]),
    }
    for key in ("cpu_ms_per_prepare", "cpu_ms_per_unprepare", "cpu_ms_per_cycle", "cpu_ms_per_paced_cycle",
                "idle_cpu_ms_per_second"):
        out[key.removesuffix("_ms")] = ratio(current[key], baseline[key])
    for phase in COMPARED_PHASES:
        for stat in ("p50_ms", "p99_ms"):
            out[f"{phase}.{stat.removesuffix('_ms')}"] = ratio(current[phase][stat], baseline[phase][stat])
    for key in ("rss_kib_after_warmup", f"rss_kib_after_{cycles}_cycles"):
        out[key.removeprefix("rss_kib_")] = ratio(current[key], baseline[key])
    return out


def run(
    cycles: int = 1000,
    rounds: int = 200,
    baseline_ref: str | None = None,
    current_ref: str | None = None,
    starts: int | None = None,
    example: bool = False,
    nvidia: bool = False,
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    """The figures of the working tree's plugin (or `current_ref`'s); with `baseline_ref`,
    also of that commit's, in the same run: `starts` plugin starts of each side (default
    2; 1 without a baseline), in the order B C C B B C ..., `rounds` timed calls per phase
    and side shared among them, `cycles` per start. With `example`, dra-example-driver's
    plugin is the baseline side instead of a commit; with `nvidia`, NVIDIA's plugin is a
    side too (B C N N C B ...)."""
    sides = [commit_side(current_ref, "current") if current_ref else working_tree_side()]
    if example:
        sides.insert(0, example_side())
        baseline_ref = baseline_ref or "example"
    elif baseline_ref:
        sides.insert(0, commit_side(baseline_ref, "baseline"))
    if nvidia:
        sides.append(nvidia_side())
    compared = len(sides) > 1
    starts = starts or (2 if compared else 1)
    for side in sides:
        check_imports(side)
    order: list[Side] = []
    for i in range(starts):
        order += sides if i % 2 == 0 else sides[::-1]
    per_start_rounds = max(rounds // starts, 10)
    with fresh_control_plane("dra-bench-") as (cp, work):
        api = sync_client(str(cp.kubeconfig))
        create_node(api, NODE)
        claims = _claims(api)
        nvidia_claims: list[ClaimName] = []
        nvidia_devices: list[str] = []

        def claims_of_nvidia() -> list[ClaimName]:
            """Claims of the GPUs NVIDIA's plugin published, made at its first start."""
            if not nvidia_claims:
                nvidia_devices.extend(nvidia_driver.claim_devices(api, NODE))
                nvidia_claims.extend(_claims(api, nvidia_driver.NVIDIA_DRIVER, "n", nvidia_devices))
            return nvidia_claims

        side_claims: dict[str, list[ClaimName] | Callable[[], list[ClaimName]]] = {
            side.label: claims_of_nvidia
            if side.nvidia
            else _claims(api, example_driver.EXAMPLE_DRIVER, "e")
            if side.example
            else claims
            for side in sides
        }
        _driver_root(work / "driver-root")
        binary = kubelet_client.build()
        blocks: dict[str, list[Block]] = {side.label: [] for side in sides}
        data_dir = work
        failed: list[dict[str, Any]] = []
        for index, side in enumerate(order):
            try:
                block, data_dir = measure_block(
                    side, index, cp, work, side_claims[side.label], binary, per_start_rounds, cycles,
                    None if blocks[side.label] else profile_dir,  # each side's first start is profiled
                )
            except (RuntimeError, TimeoutError) as e:
                if not compared:
                    raise
                # one side's failure (NVIDIA's without NVML, a refused call) leaves the others' figures
                print(f"start {index + 1}/{len(order)} {side.label} FAILED: {e}", file=sys.stderr, flush=True)
                failed.append({"start": index + 1, "side": side.label, "error": str(e)[-3000:]})
                continue
            blocks[side.label].append(block)
            p50_ms = statistics.median(block.phases["prepare_sequential"]) * 1000
            print(
                f"start {index + 1}/{len(order)} {side.label}: registered in"
                f" {block.start_to_registered_s:.3f} s, prepare p50 {p50_ms:.3f} ms",
                file=sys.stderr,
                flush=True,
            )
        floor_calls = _floor_grpc(binary, work, rounds)
        every = [b for side_blocks in blocks.values() for b in side_blocks]
        get_go = [t for b in every for t in b.phases["get_sequential"]]
        get_go_concurrent = [t for b in every for t in b.phases["get_concurrent"]]
        floor = {
            "get": _percentiles(_floor_get(cp, f"{CLAIMS}/c0", rounds)),
            "durable_write": _percentiles(_floor_durable_write(data_dir, rounds)),
            "grpc_empty": _percentiles(floor_calls["empty"]),
            "grpc_empty_16_concurrent": _percentiles(floor_calls["empty_concurrent"]),
            "get_go": _percentiles(get_go),
            "get_go_16_concurrent": _percentiles(get_go_concurrent),
        }
    run_fs = "tmpfs" if _shm_is_tmpfs() else "not a tmpfs (no /dev/shm)"
    results = {side.label: _side_result(blocks[side.label], cycles) for side in sides if blocks[side.label]}
    for result in results.values():
        result["ratios"] = _ratios({**result, "floor": floor})
    if not compared:
        current = results["current"]
        start_to_registered, ratios = current.pop("start_to_registered_s"), current.pop("ratios")
        return {
            "code": sides[0].describe,
            "start_to_registered_s": start_to_registered,
            "state_and_cdi_dirs": run_fs,
            **current,
            "floor": floor,
            "ratios": ratios,
        }
    compared_with = {
        f"current_to_{label}": _current_to_baseline(results["current"], results[label], cycles)
        for label in ("baseline", "nvidia")
        if label in results and "current" in results
    }
    out: dict[str, Any] = {
        "method": f"{starts} plugin starts of each side, in the order {' '.join(s.label for s in order)};"
        f" {per_start_rounds} sequential calls per phase and start; {cycles} cycles per start",
        "state_and_cdi_dirs": run_fs,
        "code": {side.label: side.describe for side in sides},
        **compared_with,
        **results,
        "floor": floor,
    }
    if nvidia:  # the GPUs its 16 claims were allocated, in turn
        out["nvidia_devices"] = nvidia_devices
    if failed:
        out["failed_starts"] = failed
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prepare", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--baseline-ref",
        metavar="REF",
        help="also measure this commit's plugin (a git worktree /tmp/bench-baseline-<sha12>), interleaved",
    )
    parser.add_argument(
        "--example",
        action="store_true",
        help="the baseline side is dra-example-driver's kubelet plugin (hack/bench/example-driver.sh)",
    )
    parser.add_argument(
        "--nvidia",
        action="store_true",
        help="also NVIDIA's gpu-kubelet-plugin (hack/bench/nvidia-driver.sh; needs NVML: a GPU host)",
    )
    parser.add_argument(
        "--current-ref",
        metavar="REF",
        help="measure this commit's plugin as the current side instead of the working tree's",
    )
    parser.add_argument(
        "--starts", type=int, help="plugin starts per side (default 2 with a baseline, else 1)"
    )
    parser.add_argument("--rounds", type=int, default=200, help="timed sequential calls per phase and side")
    parser.add_argument(
        "--cycles", type=int, default=1000, help="prepare/unprepare cycles per start before RSS"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="after the figures, profile our plugin (py-spy and per-thread CPU, benchmarks.plugin_profile)"
        f" over {PROFILE_CYCLES} more cycles and {PROFILE_IDLE_S:g} s idle; raw samples into DIR",
    )
    args = parser.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    result = run(
        args.cycles, args.rounds, args.baseline_ref, args.current_ref, args.starts, args.example, args.nvidia,
        args.profile,
    )
    report("prepare", result)
    if "current" in result and isinstance(result.get("code"), dict):
        print(comparison_table(result, args.cycles), file=sys.stderr, flush=True)


def comparison_table(result: dict[str, Any], cycles: int) -> str:
    """Each side's figures side by side (baseline, current, nvidia: those measured) with the
    ratios of current to each other side."""
    others = [label for label in ("baseline", "nvidia") if f"current_to_{label}" in result]
    labels = [label for label in ("baseline", "current", "nvidia") if label in others or label == "current"]
    ratios = {label: result[f"current_to_{label}"] for label in others}
    rows = [("figure", *labels, *(f"current/{label}" for label in others))]

    def row(name: str, keys: tuple[str, ...], ratio_key: str) -> None:
        def value(side: Any) -> str:
            for key in keys:
                side = side[key]
            return str(side)

        rows.append(
            (name, *(value(result[label]) for label in labels),
             *(str(ratios[label][ratio_key]) for label in others))
        )

    row("start to registered (s)", ("start_to_registered_s",), "start_to_registered")
    for key in ("start_cpu_s", "cpu_ms_per_prepare", "cpu_ms_per_unprepare", "cpu_ms_per_cycle",
                "cpu_ms_per_paced_cycle", "idle_cpu_ms_per_second"):
        row(key, (key,), key.removesuffix("_s").removesuffix("_ms"))
    for phase in COMPARED_PHASES[:-1]:  # the printed table leaves out the 16 empty calls
        for stat in ("p50", "p99"):
            row(f"{phase} {stat} (ms)", (phase, f"{stat}_ms"), f"{phase}.{stat}")
    for key in ("rss_kib_after_warmup", f"rss_kib_after_{cycles}_cycles"):
        row(f"{key} ", (key,), key.removeprefix("rss_kib_"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"{label:8} {result['code'][label]}" for label in labels]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
