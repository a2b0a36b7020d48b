"""The benchmarks' kubelet: builds and runs `kubelet-client` (benchmarks/kubeletclient, Go).

The kubelet talks to a DRA plugin from grpc-go over one connection per plugin. The
benchmarks time the plugin through `kubelet-client`, which does the same (one
grpc.NewClient connection, insecure, on the plugin's unix socket), so that concurrent
figures are the plugin's and not the cost of many Python client threads on a small
machine. `build()` compiles it with hack/bench/build.sh (cached outside the repository);
`run()` feeds it the claims and returns each phase's per-call latencies in seconds.

This module only measures. It must not register with the plugin (the caller passes the
DRA socket the plugin advertised), must not be imported by the driver (dra_driver,
controller), and must not download anything itself: the build script uses the Go module
cache, and the Go module proxy only when that cache is cold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "hack" / "bench" / "build.sh"


def build() -> Path:
    """Build kubelet-client (a no-op when cached) and return the binary's path.

    The script's progress (stderr) is passed through to ours as it comes; its last stdout
    line is the binary's path. `$DRA_KUBELET_CLIENT` names a binary built elsewhere instead
    (the GPU host has no Go: hack/h200/build.sh carries one there), as `$DRA_CLUSTER_BIN`
    does for the control plane.
    """
    override = os.environ.get("DRA_KUBELET_CLIENT")
    if override:
        if not os.access(override, os.X_OK):
            raise RuntimeError(f"DRA_KUBELET_CLIENT={override} is not an executable file: fix or unset it")
        return Path(override)
    proc = subprocess.Popen(
        ["bash", str(BUILD_SCRIPT)],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    progress = proc.stderr
    stderr_lines: list[str] = []

    def relay() -> None:
        for line in progress:
            stderr_lines.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    relay_thread = threading.Thread(target=relay, name="kubelet-client-build-stderr", daemon=True)
    relay_thread.start()
    stdout = proc.stdout.read()
    returncode = proc.wait()
    relay_thread.join()
    lines = stdout.splitlines()
    if returncode != 0 or not lines:
        raise RuntimeError(
            f"{BUILD_SCRIPT} failed (exit {returncode}):\n{''.join(stderr_lines)}{stdout}".rstrip()
        )
    binary = Path(lines[-1].strip())
    if not binary.is_file():
        raise RuntimeError(f"{BUILD_SCRIPT} printed {binary}, which is not a file:\n{''.join(stderr_lines)}")
    return binary


@dataclass(frozen=True)
class ApiServer:
    """Where kubelet-client also GETs the claims from (the API server's own figure)."""

    url: str
    ca_file: Path
    token_file: Path


def run(
    binary: Path,
    socket: Path,
    claims: Sequence[tuple[str, str, str]],
    rounds: int,
    concurrent_rounds: int,
    width: int = 16,
    only_empty: bool = False,
    api: ApiServer | None = None,
) -> dict[str, list[float]]:
    """Time the plugin behind `socket` (its DRA service) from kubelet-client.

    `claims` are (namespace, name, uid) of allocated claims, at least `width` of them
    unless `only_empty`. Returns phase -> per-call latency in seconds: `empty`,
    `empty_concurrent`, and unless `only_empty` also `prepare_sequential`,
    `unprepare_sequential`, `prepare_concurrent`, `unprepare_concurrent`, and with `api`
    `get_sequential` and `get_concurrent` (GETs of the same claims). Raises
    RuntimeError with the client's stderr if it fails (a call failing or a claim answered
    with an error included).
    """
    args = [
        str(binary),
        "-socket",
        str(socket),
        "-rounds",
        str(rounds),
        "-concurrent-rounds",
        str(concurrent_rounds),
        "-width",
        str(width),
    ]
    if only_empty:
        args.append("-only-empty")
    if api is not None:
        args += ["-api-server", api.url, "-api-ca", str(api.ca_file), "-api-token-file", str(api.token_file)]
    claims_json = json.dumps([{"namespace": ns, "name": name, "uid": uid} for ns, name, uid in claims])
    done = subprocess.run(args, input=claims_json, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{binary.name} failed (exit {done.returncode}):\n{done.stderr}".rstrip())
    try:
        parsed = json.loads(done.stdout)
    except json.JSONDecodeError as e:
        raise RuntimeError(f"{binary.name} printed no JSON ({e}):\n{done.stdout}\n{done.stderr}") from e
    if not isinstance(parsed, dict):
        raise RuntimeError(f"{binary.name} printed {type(parsed).__name__}, not an object of phases")
    phases: dict[str, list[float]] = {}
    for phase, latencies in parsed.items():
        if not isinstance(latencies, list) or not all(isinstance(t, int | float) for t in latencies):
            raise RuntimeError(f"{binary.name}: phase {phase!r} is not a list of seconds")
        phases[phase] = [float(t) for t in latencies]
    return phases
