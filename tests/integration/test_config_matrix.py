"""Device x config x class: no claim is ever admitted and then stuck holding a device.

One `dra-driver kubelet-plugin --dynamic-mig --memory-shares` on the simulated
`hgx-h200-mig` node (GPU 0 in MIG mode and empty: dynamic slices; GPU 1 in MIG mode with a
static 3g.71gb; GPU 2 whole: the whole-GPU class and memory shares), the chart's
DeviceClasses and claim-config policy as `helm template` renders them with both features
on, the real scheduler, and the kubelet's side of Prepare from tests/harness/kubelet.py.

Every device kind (whole GPU, static MIG, dynamic MIG slice, memory share) meets every
config (none; ours with MPS and with TimeSlicing; NVIDIA's GpuConfig and MigDeviceConfig
with each strategy). A cell either runs (created, allocated, and Prepare answers with the
devices, with the MPS client settings exactly where MPS was asked) or is refused at
creation with a message that says what to change. Admitted and then refused by the plugin
is the failure this test exists for. The matrix is printed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.driver_image import CHART, build_helm
from tests.harness.fake_mps import install_fake_mps_control
from tests.harness.kubelet import ClaimName, KubeletSide
from tests.harness.objects import (
    api_error,
    get_claim,
    get_pod,
    scheduler_reason,
    sync_request,
    wait_for,
)
from tests.harness.plugin_node import plugin_node

RESOURCE_API = "/apis/resource.k8s.io/v1"
SLICES = f"{RESOURCE_API}/resourceslices"
NODE = f"matrix-{uuid.uuid4().hex[:6]}"
A = f'device.attributes["{DRIVER}"]'
NV = "resource.nvidia.com/v1beta1"
OURS = f"{DRIVER}/v1alpha1"

# device kind -> (class, extra selector, capacity request)
KINDS: dict[str, tuple[str, str | None, dict[str, str] | None]] = {
    "whole GPU": (DRIVER, None, None),
    "static MIG": (f"mig.{DRIVER}", f'"uuid" in {A}', None),
    "dynamic MIG slice": (f"mig-dynamic.{DRIVER}", f'{A}.profile == "1g.18gb"', None),
    "memory share": (f"gpu-share.{DRIVER}", None, {"memory": "8Gi"}),
}
MPS_LIMIT = {"defaultPinnedDeviceMemoryLimit": "4Gi"}
CONFIGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "ours MPS": {"apiVersion": OURS, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mps": MPS_LIMIT}},
    "ours TimeSlicing": {"apiVersion": OURS, "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}},
    "NVIDIA GpuConfig TimeSlicing": {
        "apiVersion": NV,
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing"},
    },
    "NVIDIA GpuConfig MPS": {
        "apiVersion": NV,
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": MPS_LIMIT},
    },
    "NVIDIA MigDeviceConfig TimeSlicing": {
        "apiVersion": NV,
        "kind": "MigDeviceConfig",
        "sharing": {"strategy": "TimeSlicing"},
    },
    "NVIDIA MigDeviceConfig MPS": {
        "apiVersion": NV,
        "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": MPS_LIMIT},
    },
}
# What to change, in a refusal: the message must say one of these.
FIXES = ("use kind", "remove", "set strategy", "ask for", "write", "use one of", "must be")


@dataclass
class Bench:
    api: client.ApiClient
    plugin: DriverProcess
    kubelet: KubeletSide


def _chart(tmp: Path) -> list[dict[str, Any]]:
    env = {
        **os.environ,
        **{k: str(tmp / k.lower()) for k in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")},
    }
    docs = []
    for template in ("deviceclasses", "memory-shares", "claim-config-policy"):
        out = subprocess.run(
            [
                str(build_helm()),
                "template",
                "r",
                str(CHART),
                "--set",
                "dynamicMig.enabled=true",
                "--set",
                "memoryShares.enabled=true",
                "--show-only",
                f"templates/{template}.yaml",
            ],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        docs += [d for d in yaml.safe_load_all(out.stdout) if d]
    return docs


def _collection(doc: dict[str, Any]) -> str:
    group, _, version = doc["apiVersion"].rpartition("/")
    plural = {
        "DeviceClass": "deviceclasses",
        "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
        "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
    }[doc["kind"]]
    return f"/apis/{group}/{version}/{plural}"


def _apply(api: client.ApiClient, doc: dict[str, Any]) -> None:
    try:
        sync_request(api, "POST", _collection(doc), doc)
    except ApiException as e:
        if e.status != 409:
            raise
        sync_request(api, "DELETE", f"{_collection(doc)}/{doc['metadata']['name']}")
        wait_for(f"{doc['metadata']['name']} replaced", lambda: _try_create(api, doc), timeout=30)


def _try_create(api: client.ApiClient, doc: dict[str, Any]) -> bool:
    try:
        sync_request(api, "POST", _collection(doc), doc)
    except ApiException as e:
        if e.status == 409:
            return False
        raise
    return True


def _fake_driver_root(root: Path) -> Path:
    lib = root / "lib64"
    lib.mkdir(parents=True)
    elf = Path("/bin/true").resolve()
    for name in ("libcuda.so", "libnvidia-ml.so"):
        real = lib / f"{name}.580.159.04"
        shutil.copy(elf, real)
        (lib / f"{name}.1").symlink_to(real.name)
    install_fake_mps_control(root)
    return root


@pytest.fixture(scope="module")
def bench(control_plane: ControlPlane, api: client.ApiClient) -> Iterator[Bench]:
    base = Path(tempfile.mkdtemp(prefix="mx-", dir="/tmp"))
    base.chmod(0o755)
    docs = _chart(base / "helm")
    for doc in docs:
        _apply(api, doc)
    try:
        with plugin_node(
            api,
            control_plane.kubeconfig,
            NODE,
            "hgx-h200-mig",
            base / "n",
            ("--driver-root", str(_fake_driver_root(base / "driver")), "--dynamic-mig", "--memory-shares"),
        ) as n:
            yield Bench(api, n.plugin, n.side)
    finally:
        for doc in reversed(docs):
            try:
                sync_request(api, "DELETE", f"{_collection(doc)}/{doc['metadata']['name']}")
            except ApiException as e:
                if e.status != 404:
                    raise
        if not os.environ.get("KEEP_TMP"):
            shutil.rmtree(base, ignore_errors=True)


def _devices(kind: str, config: dict[str, Any] | None) -> dict[str, Any]:
    cls, selector, capacity = KINDS[kind]
    exactly: dict[str, Any] = {"deviceClassName": cls}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    devices: dict[str, Any] = {"requests": [{"name": "dev", "exactly": exactly}]}
    if config is not None:
        devices["config"] = [{"requests": ["dev"], "opaque": {"driver": DRIVER, "parameters": config}}]
    return devices


def _outcome(bench: Bench, ns: str, kind: str, config_name: str) -> tuple[str, str]:
    """("runs" | "refused" | "STUCK", what happened) for one cell."""
    api = bench.api
    config = CONFIGS[config_name]
    name = "cell"
    try:
        sync_request(
            api,
            "POST",
            f"{RESOURCE_API}/namespaces/{ns}/resourceclaims",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name},
                "spec": {"devices": _devices(kind, config)},
            },
        )
    except ApiException as e:
        return "refused", api_error(e).split("denied request: ", 1)[-1]
    sync_request(
        api,
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": NODE},
                "automountServiceAccountToken": False,
                "resourceClaims": [{"name": "c", "resourceClaimName": name}],
                "containers": [
                    {
                        "name": "c",
                        "image": "busybox:1.37",
                        "command": ["sleep", "1"],
                        "resources": {"claims": [{"name": "c"}]},
                    }
                ],
            },
        },
    )
    try:
        wait_for("the cell's pod bound", lambda: get_pod(api, ns, name)["spec"].get("nodeName"), timeout=30)
    except TimeoutError:
        return "STUCK", f"admitted but never allocated: {scheduler_reason(api, ns, name)}"
    claim = get_claim(api, ns, name)
    ref = ClaimName(ns, name, claim["metadata"]["uid"])
    answer = bench.kubelet.prepare(ref).claims[ref.uid]
    try:
        if answer.error:
            return "STUCK", f"admitted and allocated, then refused by the plugin: {answer.error}"
        env = _env(bench, answer)
        wants_mps = kind == "memory share" or "MPS" in config_name
        has_mps = any(e.startswith("CUDA_MPS_PIPE_DIRECTORY=") for e in env)
        if wants_mps != has_mps:
            return "STUCK", f"prepared without what it asked: MPS asked {wants_mps}, given {has_mps}"
        limit = next((e for e in env if e.startswith("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=")), "")
        allocated = claim["status"]["allocation"]["devices"]["results"][0]["device"]
        return "runs", allocated + (f", MPS limit {limit.split('=', 1)[1]}" if limit else "")
    finally:
        bench.kubelet.unprepare(ref)


def _env(bench: Bench, answer: Any) -> list[str]:
    out: list[str] = []
    for device in answer.devices:
        proc = subprocess.run(
            [_CDICHECK[0], "-dir", str(bench.plugin.cdi_dir), *device.cdi_device_ids],
            capture_output=True,
            text=True,
            check=True,
        )
        out += json.loads(proc.stdout)["process"]["env"]
    return out


_CDICHECK: list[str] = []


def _clear(api: client.ApiClient, ns: str) -> None:
    sync_request(api, "DELETE", f"/api/v1/namespaces/{ns}/pods", query={"gracePeriodSeconds": "0"})
    sync_request(api, "DELETE", f"{RESOURCE_API}/namespaces/{ns}/resourceclaims")
    wait_for(
        "the cell's claim gone",
        lambda: not sync_request(api, "GET", f"{RESOURCE_API}/namespaces/{ns}/resourceclaims")["items"],
        timeout=60,
    )


def test_every_cell_runs_or_is_refused_at_creation(
    bench: Bench, namespace: str, control_plane: ControlPlane
) -> None:
    _CDICHECK[:] = [str(control_plane.bin_dir / "cdicheck")]
    rows: list[tuple[str, str, str, str]] = []
    for kind in KINDS:
        for config_name in CONFIGS:
            try:
                outcome, detail = _outcome(bench, namespace, kind, config_name)
            finally:
                _clear(bench.api, namespace)
            rows.append((kind, config_name, outcome, detail))
    width = max(len(k) for k in KINDS), max(len(c) for c in CONFIGS)
    print("\n" + "\n".join(f"{k:<{width[0]}}  {c:<{width[1]}}  {o:<7}  {d[:160]}" for k, c, o, d in rows))
    stuck = [r for r in rows if r[2] == "STUCK"]
    assert not stuck, "admitted and then stuck:\n" + "\n".join(" | ".join(r) for r in stuck)
    vague = [r for r in rows if r[2] == "refused" and not any(f in r[3] for f in FIXES)]
    assert not vague, "refused without saying what to change:\n" + "\n".join(" | ".join(r) for r in vague)
    runs = {(k, c) for k, c, o, _ in rows if o == "runs"}
    # what must run: every kind bare, and each with the configs its own kind of device takes
    for kind in KINDS:
        assert (kind, "none") in runs
    assert {
        ("whole GPU", "NVIDIA GpuConfig MPS"),
        ("whole GPU", "NVIDIA GpuConfig TimeSlicing"),
        ("static MIG", "NVIDIA MigDeviceConfig TimeSlicing"),
        ("static MIG", "NVIDIA MigDeviceConfig MPS"),
        ("dynamic MIG slice", "NVIDIA MigDeviceConfig TimeSlicing"),
        ("dynamic MIG slice", "NVIDIA MigDeviceConfig MPS"),
        ("memory share", "ours MPS"),
    } <= runs


def test_the_whole_gpu_class_never_hands_out_a_gpu_in_mig_mode(bench: Bench, namespace: str) -> None:
    """All whole GPUs of the node (allocationMode All) are the one not in MIG mode; on
    d20fbb0 the class also gave out the MIG-mode GPUs, where CUDA sees no usable device."""
    api = bench.api
    exactly = {
        "deviceClassName": DRIVER,
        "allocationMode": "All",
        "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].?index.hasValue()'}}],
    }
    sync_request(
        api,
        "POST",
        f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "all"},
            "spec": {"devices": {"requests": [{"name": "all", "exactly": exactly}]}},
        },
    )
    sync_request(
        api,
        "POST",
        f"/api/v1/namespaces/{namespace}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "all"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": NODE},
                "automountServiceAccountToken": False,
                "resourceClaims": [{"name": "c", "resourceClaimName": "all"}],
                "containers": [
                    {
                        "name": "c",
                        "image": "busybox:1.37",
                        "command": ["sleep", "1"],
                        "resources": {"claims": [{"name": "c"}]},
                    }
                ],
            },
        },
    )
    try:
        wait_for("the pod bound", lambda: get_pod(api, namespace, "all")["spec"].get("nodeName"), timeout=30)
        results = get_claim(api, namespace, "all")["status"]["allocation"]["devices"]["results"]
        assert sorted(r["device"] for r in results) == ["gpu-2"]
    finally:
        _clear(api, namespace)
