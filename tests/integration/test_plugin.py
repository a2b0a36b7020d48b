"""The kubelet plugin against the real control plane, driven from the kubelet's side of the protocol.

The driver runs as its real command line in a subprocess (simulated GPUs, a fake driver
root holding ELF files under the real library names); claims are allocated by the real
scheduler; every CDI id the plugin returns is resolved by `cdicheck`, the CDI library
that containerd and CRI-O use.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client

from dra_driver.plugin.checkpoint import checkpoint_path, load, read_boot_id
from tests.harness.bodies import claim_pod, claim_template
from tests.harness.claims import CLAIMS, allocated_claim
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.kubelet import ClaimName, KubeletSide
from tests.harness.objects import create_device_class, create_node, sync_request, wait_for

PROFILE = "a100-pcie-bridged"  # 4 GPUs: gpu-0..gpu-3
PLUGIN_NODE = "plugin-node"


@pytest.fixture(scope="module")
def driver_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A driver root shaped like a real one; the files are ELF binaries so the scanner keeps them."""
    root = tmp_path_factory.mktemp("driver-root")
    lib = root / "lib64"
    lib.mkdir()
    elf = Path("/bin/true").resolve()
    for name in ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so", "libnvidia-nvvm.so"):
        real = lib / f"{name}.570.133.20"
        shutil.copy(elf, real)
        (lib / f"{name}.1").symlink_to(real.name)
    (root / "bin").mkdir()
    shutil.copy(elf, root / "bin" / "nvidia-smi")
    return root


@pytest.fixture(scope="module")
def node(api: client.ApiClient) -> str:
    create_node(api, PLUGIN_NODE)
    return PLUGIN_NODE


@pytest.fixture(scope="module")
def plugin(
    control_plane: ControlPlane, node: str, driver_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DriverProcess]:
    proc = DriverProcess(
        node,
        PROFILE,
        control_plane.kubeconfig,
        tmp_path_factory.mktemp("plugin"),
        extra_args=("--driver-root", str(driver_root)),
    )
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def device_class(api: client.ApiClient) -> str:
    name = "plugin-test-gpu"
    create_device_class(api, name, f'device.driver == "{DRIVER}"')
    return name


def _wait_slices(api: client.ApiClient, node: str) -> None:
    def published() -> bool:
        items = sync_request(
            api,
            "GET",
            "/apis/resource.k8s.io/v1/resourceslices",
            query={"fieldSelector": f"spec.nodeName={node}"},
        )["items"]
        return sum(len(s["spec"].get("devices", [])) for s in items) == 4

    wait_for("the plugin's slices", published, timeout=30)


def _pod_with_claim(
    api: client.ApiClient, namespace: str, pod: str, device_class: str, count: int = 1
) -> dict[str, Any]:
    """A pod whose claim comes from a template; returns the claim once the scheduler allocated it."""
    request = {"name": "gpu", "exactly": {"deviceClassName": device_class, "count": count}}
    templates = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates"
    sync_request(api, "POST", templates, claim_template(pod, {"requests": [request]}))
    # Pinned: other tests' nodes may still offer devices of this driver.
    body = claim_pod(pod, {"resourceClaimTemplateName": pod}, PLUGIN_NODE)
    sync_request(api, "POST", f"/api/v1/namespaces/{namespace}/pods", body)

    def allocated() -> dict[str, Any] | None:
        for claim in sync_request(api, "GET", CLAIMS.format(ns=namespace))["items"]:
            owners = [o["name"] for o in claim["metadata"].get("ownerReferences", [])]
            if pod in owners and claim.get("status", {}).get("reservedFor"):
                return claim
        return None

    return wait_for(f"claim of pod {pod} allocated", allocated, timeout=60)


def _ref(claim: dict[str, Any]) -> ClaimName:
    m = claim["metadata"]
    return ClaimName(m["namespace"], m["name"], m["uid"])


def _cdicheck(control_plane: ControlPlane, cdi_dir: Path, *ids: str) -> dict[str, Any]:
    out = subprocess.run(
        [str(control_plane.bin_dir / "cdicheck"), "-dir", str(cdi_dir), *ids],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_prepare_and_unprepare_through_the_kubelet_protocol(
    control_plane: ControlPlane,
    api: client.ApiClient,
    plugin: DriverProcess,
    node: str,
    device_class: str,
    namespace: str,
) -> None:
    _wait_slices(api, node)
    kubelet = KubeletSide(plugin.registration_socket())
    assert kubelet.info.name == DRIVER
    assert kubelet.service == "v1.DRAPlugin"
    assert list(kubelet.info.supported_versions)[:1] == ["v1.DRAPlugin"]
    claim = _pod_with_claim(api, namespace, "two-gpus", device_class, count=2)
    allocated = sorted(r["device"] for r in claim["status"]["allocation"]["devices"]["results"])

    answer = kubelet.prepare(_ref(claim)).claims[claim["metadata"]["uid"]]
    assert answer.error == ""
    assert sorted(d.device_name for d in answer.devices) == allocated
    assert {d.pool_name for d in answer.devices} == {node}
    assert all(list(d.request_names) == ["gpu"] for d in answer.devices)
    ids = [i for d in answer.devices for i in d.cdi_device_ids]
    assert all(i.startswith(f"{DRIVER}/gpu=") and claim["metadata"]["uid"] in i for i in ids)

    # The real CDI library resolves the ids into an OCI spec with exactly these GPUs.
    oci = _cdicheck(control_plane, plugin.cdi_dir, *ids)
    nodes = sorted(d["path"] for d in oci["linux"]["devices"])
    minors = sorted(int(name.removeprefix("gpu-")) for name in allocated)
    assert nodes == sorted(
        [f"/dev/nvidia{m}" for m in minors] + ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    )
    mounts = {m["destination"] for m in oci["mounts"]}
    assert "/usr/local/nvidia/lib64/libcuda.so.1" in mounts
    assert "/usr/bin/nvidia-smi" in mounts
    assert all(
        "ro" in m["options"] for m in oci["mounts"] if "nvidia" in m["source"] or "cuda" in m["source"]
    )

    # Prepare is idempotent: the same answer again.
    again = kubelet.prepare(_ref(claim)).claims[claim["metadata"]["uid"]]
    assert [list(d.cdi_device_ids) for d in again.devices] == [list(d.cdi_device_ids) for d in answer.devices]

    assert kubelet.unprepare(_ref(claim)).claims[claim["metadata"]["uid"]].error == ""
    assert not list(plugin.cdi_dir.glob(f"*{claim['metadata']['uid']}*"))
    assert kubelet.unprepare(_ref(claim)).claims[claim["metadata"]["uid"]].error == "", (
        "unknown claim: no error"
    )
    kubelet.close()


def test_bad_claims_are_refused_one_by_one(
    api: client.ApiClient, plugin: DriverProcess, node: str, device_class: str, namespace: str
) -> None:
    _wait_slices(api, node)
    kubelet = KubeletSide(plugin.registration_socket())
    good = _pod_with_claim(api, namespace, "good", device_class)
    replaced = allocated_claim(api, namespace, "replaced", [{"pool": node, "device": "gpu-0"}], device_class)
    unallocated = allocated_claim(api, namespace, "unallocated", None, device_class)
    elsewhere = allocated_claim(
        api, namespace, "elsewhere", [{"pool": "other-node", "device": "gpu-0"}], device_class
    )
    missing = allocated_claim(api, namespace, "missing", [{"pool": node, "device": "gpu-9"}], device_class)
    claims = {
        "uid": (ClaimName(namespace, "replaced", "0000-not-the-uid"), "re-created"),
        "unallocated": (_ref(unallocated), "not allocated"),
        "elsewhere": (_ref(elsewhere), "another node"),
        "missing": (_ref(missing), "does not have"),
        "traversal": (ClaimName("../etc", "x", "u1"), "not a valid Kubernetes name"),
        "slash": (ClaimName(namespace, "a/b", "u2"), "not a valid Kubernetes name"),
        "empty": (ClaimName("", "", "u3"), "empty"),
        "gone": (ClaimName(namespace, "no-such-claim", "u4"), "does not exist"),
    }
    assert replaced["metadata"]["uid"] != "0000-not-the-uid"
    response = kubelet.prepare(_ref(good), *(ref for ref, _ in claims.values()))
    assert response.claims[good["metadata"]["uid"]].error == ""
    assert len(response.claims[good["metadata"]["uid"]].devices) == 1
    for what, (ref, fragment) in claims.items():
        error = response.claims[ref.uid].error
        assert fragment in error, f"{what}: {error!r}"
    # An empty request is answered with an empty map, not an error.
    assert len(kubelet.prepare().claims) == 0

    # A garbage payload is a gRPC error for that call only; the server keeps serving.
    raw = kubelet.channel.unary_unary(
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\xff\xff\xff\xff garbage", timeout=10)
    assert err.value.code() in (
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNKNOWN,
    )
    assert plugin.proc is not None and plugin.proc.poll() is None
    again = kubelet.prepare(_ref(good))
    assert again.claims[good["metadata"]["uid"]].error == ""
    kubelet.unprepare(_ref(good))
    kubelet.close()


def test_a_device_is_never_prepared_for_two_claims(
    api: client.ApiClient, plugin: DriverProcess, node: str, device_class: str, namespace: str
) -> None:
    _wait_slices(api, node)
    kubelet = KubeletSide(plugin.registration_socket())
    first = allocated_claim(api, namespace, "first", [{"pool": node, "device": "gpu-3"}], device_class)
    second = allocated_claim(api, namespace, "second", [{"pool": node, "device": "gpu-3"}], device_class)
    assert kubelet.prepare(_ref(first)).claims[first["metadata"]["uid"]].error == ""
    error = kubelet.prepare(_ref(second)).claims[second["metadata"]["uid"]].error
    assert "already prepared for claim" in error and "first" in error
    kubelet.unprepare(_ref(first))
    assert kubelet.prepare(_ref(second)).claims[second["metadata"]["uid"]].error == ""
    kubelet.unprepare(_ref(second))
    kubelet.close()


PREPARE_FAULTS = ["prepare-after-started", "prepare-after-cdi", "prepare-after-completed"]
UNPREPARE_FAULTS = ["unprepare-after-cdi-removed", "unprepare-after-entry-removed"]


def _state(proc: DriverProcess) -> tuple[set[str], set[str]]:
    """(claim UIDs in the checkpoint, claim UIDs with a CDI spec)."""
    entries = set(load(checkpoint_path(proc.state_dir), read_boot_id()).checkpoint.claims)
    specs = {p.stem.split("_", 1)[1] for p in proc.cdi_dir.glob(f"{DRIVER}-gpu_*.json")}
    return entries, specs


@pytest.mark.parametrize("fault", PREPARE_FAULTS + UNPREPARE_FAULTS)
def test_kill_at_every_step_then_repeat(
    control_plane: ControlPlane,
    api: client.ApiClient,
    node: str,
    device_class: str,
    driver_root: Path,
    namespace: str,
    short_tmp: Path,
    fault: str,
) -> None:
    crash_node = f"crash-{fault}"
    create_node(api, crash_node)
    proc = DriverProcess(
        crash_node,
        PROFILE,
        control_plane.kubeconfig,
        short_tmp,
        extra_args=("--driver-root", str(driver_root)),
    )
    proc.start()
    try:
        claim = allocated_claim(
            api, namespace, "crashy", [{"pool": crash_node, "device": "gpu-1"}], device_class
        )
        ref, uid = _ref(claim), claim["metadata"]["uid"]
        kubelet = KubeletSide(proc.registration_socket())
        baseline = None
        if fault.startswith("unprepare"):
            baseline = kubelet.prepare(ref).claims[uid]
            assert baseline.error == ""
        proc.stop()
        proc.env = {"DRA_DRIVER_FAULT": fault}
        proc.start()
        kubelet = KubeletSide(proc.registration_socket())
        with pytest.raises(grpc.RpcError):
            (kubelet.prepare if fault.startswith("prepare") else kubelet.unprepare)(ref)
        assert proc.wait_exit() == 137, proc.log_tail()

        proc.env = {}
        proc.start()
        entries, specs = _state(proc)
        assert entries == specs, "after recovery every spec has its entry and every entry its spec"
        kubelet = KubeletSide(proc.registration_socket())
        if fault.startswith("prepare"):
            answer = kubelet.prepare(ref).claims[uid]
            assert answer.error == ""
            assert [d.device_name for d in answer.devices] == ["gpu-1"]
            assert _state(proc) == ({uid}, {uid})
        else:
            assert kubelet.unprepare(ref).claims[uid].error == ""
            assert _state(proc) == (set(), set())
            assert baseline is not None
        kubelet.close()
    finally:
        proc.stop(signal.SIGKILL)


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_health_stream_lists_every_device(plugin: DriverProcess, version: str) -> None:
    from dra_driver.kubeletapi.drahealth.v1 import api_pb2 as h1
    from dra_driver.kubeletapi.drahealth.v1 import api_pb2_grpc as h1_grpc
    from dra_driver.kubeletapi.drahealth.v1alpha1 import api_pb2 as h1a1
    from dra_driver.kubeletapi.drahealth.v1alpha1 import api_pb2_grpc as h1a1_grpc

    pb, stub_class = (
        (h1, h1_grpc.DRAResourceHealthStub) if version == "v1" else (h1a1, h1a1_grpc.DRAResourceHealthStub)
    )
    kubelet = KubeletSide(plugin.registration_socket())
    assert f"{version}.DRAResourceHealth" in kubelet.info.supported_versions
    stream = stub_class(kubelet.channel).NodeWatchResources(pb.NodeWatchResourcesRequest(), timeout=10)
    first = next(iter(stream))
    stream.cancel()
    # every device the plugin can prepare: the GPUs and their share views (claims allocated
    # while --memory-shares was on keep their health after it is turned off)
    expected = sorted([f"gpu-{i}" for i in range(4)] + [f"gpu-{i}-share" for i in range(4)])
    assert sorted(d.device.device_name for d in first.devices) == expected
    assert {d.health for d in first.devices} == {pb.HEALTHY}
    assert {d.device.pool_name for d in first.devices} == {plugin.node}
    kubelet.close()


def test_a_refused_registration_is_logged_not_fatal(plugin: DriverProcess) -> None:
    from dra_driver.kubeletapi.pluginregistration.v1 import api_pb2 as reg
    from dra_driver.kubeletapi.pluginregistration.v1 import api_pb2_grpc as reg_grpc

    with grpc.insecure_channel(f"unix://{plugin.registration_socket()}") as channel:
        reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
            reg.RegistrationStatus(plugin_registered=False, error="driver name collides with another plugin"),
            timeout=10,
        )
    wait_for(
        "the refusal in the log", lambda: "collides with another plugin" in plugin.log_tail(20000), timeout=10
    )
    assert '"level": "error"' in next(
        line for line in plugin.log_tail(20000).splitlines() if "collides with another plugin" in line
    )
    assert plugin.proc is not None and plugin.proc.poll() is None
    KubeletSide(plugin.registration_socket()).close()  # registers again
