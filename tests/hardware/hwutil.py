"""Helpers of the hardware tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dra_driver import DEFAULT_DRIVER_NAME
from dra_driver.devices import node_devices
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.prepared import PreparedDevice
from dra_driver.plugin.state import NodePreparer
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.policy import Sharing
from tests.harness.claims_in_memory import ClaimsInMemory

DRIVER = DEFAULT_DRIVER_NAME
NODE = "h200-node"
# The Python (with torch) that runs inside the containers, as uid 65534.
WORKLOAD_PYTHON = os.environ.get("HW_CONTAINER_PYTHON") or sys.executable


def dra_driver(command: str) -> list[str]:
    """`dra-driver <command>` without the top-level CLI module, which imports the Kubernetes
    client for other subcommands (not installed on the GPU host): the same click command,
    with logging configured as `dra-driver` does it (to stderr)."""
    module = {"inventory": "inventory", "cdi": "cdi"}[command]
    code = (
        "from dra_driver import log; log.configure('info', 'json'); "
        f"from dra_driver.commands.{module} import {command}; {command}(prog_name='dra-driver {command}')"
    )
    return [sys.executable, "-c", code]


def simulate_args() -> list[str]:
    """`--simulate <profile>` for the driver's commands in a dry run (HW_SIMULATE), else nothing."""
    profile = os.environ.get("HW_SIMULATE")
    return ["--simulate", profile] if profile else []


@functools.cache
def gpu_absent_reason() -> str | None:
    """Why this host cannot run the GPU tests, or None if it can."""
    if os.environ.get("HW_SIMULATE"):
        return None
    if not os.path.exists("/dev/nvidiactl"):
        return "no NVIDIA GPU here (/dev/nvidiactl is missing)"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() < 1:
                return "NVML reports no GPU"
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # no library, no driver: anything NVML raises means no GPU
        return f"NVML is not usable here: {e}"
    return None


@functools.cache
def container_absent_reason() -> str | None:
    if os.geteuid() != 0:
        return "containers need root"
    if shutil.which("unshare") is None:
        return "util-linux unshare is missing"
    probe = subprocess.run(
        ["unshare", "--mount", "--pid", "--fork", "--mount-proc", "--propagation", "private", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        return f"cannot create mount+PID namespaces here: {probe.stderr.strip()}"
    return None


# --------------------------------------------------------------------------- results


@dataclass
class Recorder:
    root: Path
    count: int = 0

    def __call__(self, name: str, command: str | Sequence[str], output: str, note: str = "") -> Path:
        """Save one command and its output as `NN-name.txt` (and print it, for `-s` logs)."""
        self.count += 1
        cmd = command if isinstance(command, str) else shlex.join(command)
        text = f"$ {cmd}\n{output.rstrip()}\n" + (f"\n# {note}\n" if note else "")
        path = self.root / f"{self.count:02d}-{name}.txt"
        path.write_text(text)
        print(f"\n===== {path.name}\n{text}", flush=True)
        return path

    def json(self, name: str, command: str | Sequence[str], obj: Any, note: str = "") -> Path:
        return self(name, command, json.dumps(obj, indent=2), note)

    def join(self) -> None:
        parts = []
        for path in sorted(self.root.glob("[0-9][0-9]-*.txt")):
            parts.append(f"## {path.name}\n\n```\n{path.read_text().rstrip()}\n```\n")
        (self.root / "ALL.md").write_text("\n".join(parts))


def run(cmd: Sequence[str], timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False, **kw)


def smi(driver_root: str) -> str:
    """nvidia-smi of the host (from the driver root if it has one)."""
    for candidate in (os.path.join(driver_root, "bin/nvidia-smi"), shutil.which("nvidia-smi") or ""):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.skip("nvidia-smi not found")


def claim_object(
    uid: str, name: str, device: str = "gpu-0", config: list[Any] | None = None
) -> dict[str, Any]:
    """A ResourceClaim as the API server returns it once the scheduler allocated `device`."""
    devices: dict[str, Any] = {
        "results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}]
    }
    if config:
        devices["config"] = config
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": name, "uid": uid},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra-driver.dev"}}]}
        },
        "status": {"allocation": {"devices": devices}},
    }


def mps_processes() -> list[str]:
    """Every nvidia-cuda-mps-* process on the host (pid and command line)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if "nvidia-cuda-mps" in cmdline:
            found.append(f"{entry.name} {cmdline}")
    return found


def make_preparer(
    tmp: Path,
    inventory: Any,
    driver_files: Any,
    *claims: dict[str, Any],
    mps: MpsControl | None = None,
    devices: Any = None,
) -> NodePreparer:
    """The driver's own preparer for this host, serving `claims`: the host's devices unless
    `devices` names others (e.g. with share views)."""
    (tmp / "state").mkdir(parents=True, exist_ok=True)
    return NodePreparer(
        driver=DRIVER,
        pool=NODE,
        devices=node_devices(inventory) if devices is None else devices,
        claims=ClaimsInMemory(*claims),
        driver_files=driver_files,
        cdi_dir=tmp / "cdi",
        state_dir=tmp / "state",
        sharing=Sharing(DRIVER, NODE, mps or MpsControl(tmp / "mps", "/")),
    )


async def prepare_one(preparer: NodePreparer, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
    """Prepare one claim; its devices, or the test fails with the driver's error."""
    result = (await preparer.prepare([ref]))[ref.uid]
    assert result.error is None, result.error
    return result.devices
