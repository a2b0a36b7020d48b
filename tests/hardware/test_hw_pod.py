"""6. A Pod gets the real GPU through the whole stack (issue 17): the real kube-scheduler
allocates the driver's published slice, the real kubelet calls the driver's
NodePrepareResources, containerd injects the claim's CDI spec and runc makes the container.

One node on this host (tests.harness.node: containerd, runc and the kubelet in a sandbox),
the control plane of tests.harness.cluster, and `dra-driver kubelet-plugin` with real NVML,
the host's driver root and `--memory-shares`. The test image is made here from parts that
hack/h200/build.sh carried (busybox, Debian's glibc, cuda-probe from hack/h200/cuda-probe.c)
plus, in the same layer, the host driver's own nvidia-smi, libnvidia-ml, libcuda and PTX JIT
copied from the driver root: a pod WITHOUT a claim then has every program and library and
must still see no GPU, because only the claim's CDI spec brings the device nodes (and with
them runc's device-cgroup rules). With a claim, the spec's bind mounts cover those copies;
the probe reports the st_dev/st_ino of the libcuda it loaded, and the shell those of
nvidia-smi, so the test can tell the driver root's files from the image's.

Every pod runs as uid 65534 (root could re-create a missing /dev/nvidia0 through NVML,
reference/h200-host.md). Needs root, the GPU, and the builds unpacked by hack/h200/run.sh
(DRA_CLUSTER_BIN, DRA_NODE_BIN, H200_IMAGE_PARTS); skipped without the image parts.
HW_SIMULATE=<profile> with DRA_DRIVER_ROOT at a stand-in rehearses the plumbing without a GPU
(run.sh does it with H200_SIMULATE): the assertions about what the GPU answers fail there.
This module starts and stops its own cluster; it changes nothing else on the host.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hwutil import DRIVER, NODE, Recorder, run, smi

from dra_driver.driver_root import DriverFiles
from tests.harness.cluster import ControlPlane
from tests.harness.examples import device_class_files, wait_for_slices
from tests.harness.images import PATH_ENV, Entry, write_oci_archive
from tests.harness.node import Node, Nodes, NodeSpec, node_tokens
from tests.harness.objects import (
    RESOURCE_API,
    apply_documents,
    create_namespace,
    create_object,
    get_pod,
    sync_client,
    sync_request,
    wait_for,
)
from tests.node.pods import cdi_specs_of, delete_pod, describe, pod_claims, wait_gone, wait_running

pytestmark = [pytest.mark.hardware, pytest.mark.container]

IMAGE = "localhost/dra-h200-probe:1"  # not `latest`: IfNotPresent, never pulled
NAMESPACE = "h200"
USER = 65534
SHARE_CLASS = f"gpu-share.{DRIVER}"
# The driver files the image gets its own copies of: (kind, name as the CDI spec mounts it).
IMAGE_DRIVER_FILES = (
    ("bin", "nvidia-smi"),
    ("lib", "libcuda.so.1"),
    ("lib", "libnvidia-ml.so.1"),
    ("lib", "libnvidia-ptxjitcompiler.so.1"),
)
LIB_DIR = "usr/lib/x86_64-linux-gnu"  # one of the spec's library dirs (dra_driver.cdi.builders)
BIN_DIR = "usr/bin"
# The same command in every pod; sections that `sections()` splits the log into.
PROBE = r"""
echo "--- id"; id
echo "--- files"
for f in /usr/bin/nvidia-smi /usr/lib/x86_64-linux-gnu/libcuda.so.1; do
  echo "$f $(stat -L -c '%d %i' "$f" 2>&1)"
done
echo "--- devices"; ls -l /dev/nvidia* 2>&1
echo "--- env"; env | grep -E '^(GPU_DRA|CUDA_MPS|NVIDIA)' | sort
echo "--- nvidia-smi -L"; nvidia-smi -L 2>&1; echo "exit $?"
echo "--- cuda-probe"; cuda-probe ALLOCS 2>&1; echo "exit $?"
echo "--- end"
sleep 3600
"""
JSON = dict[str, Any]


def image_parts() -> Path:
    parts = os.environ.get("H200_IMAGE_PARTS")
    if not parts or not Path(parts, "bin", "cuda-probe").exists():
        pytest.skip("no test image parts (H200_IMAGE_PARTS): run hack/h200/build.sh, then hack/h200/run.sh")
    return Path(parts)


def driver_file_sources(files: DriverFiles) -> dict[str, str]:
    """Image path -> the driver root's file (as this process sees it) for IMAGE_DRIVER_FILES."""
    out: dict[str, str] = {}
    for kind, name in IMAGE_DRIVER_FILES:
        if kind == "bin":
            found = [b.host_path for b in files.binaries if b.name == name]
            target = f"{BIN_DIR}/{name}"
        else:
            found = [lib.host_path for lib in files.libraries if name in lib.names]
            target = f"{LIB_DIR}/{name}"
        if found:
            out[target] = found[0]
    return out


def probe_image(path: Path, parts: Path, files: DriverFiles) -> tuple[Path, dict[str, str]]:
    """The test image as an OCI archive, and what it holds of the driver (image path -> source)."""
    dirs = [
        "bin",
        "dev",
        "etc",
        "lib",
        "lib64",
        "proc",
        "sys",
        "tmp",
        "usr",
        "usr/bin",
        "usr/lib",
        LIB_DIR,
        "usr/local",
        "usr/local/bin",
        "var",
    ]
    entries = [Entry(d, "dir", mode=0o1777 if d == "tmp" else 0o755) for d in dirs]
    busybox = parts / "bin" / "busybox"
    entries.append(Entry("bin/busybox", "file", busybox.read_bytes()))
    listed = subprocess.run([str(busybox), "--list-full"], capture_output=True, text=True, check=True)
    taken = {"bin/busybox"}
    for applet in sorted({a.strip() for a in listed.stdout.splitlines() if a.strip()} - taken):
        entries.append(Entry(applet, "symlink", target="/bin/busybox"))
    for lib in sorted((parts / "lib" / "x86_64-linux-gnu").iterdir()):
        entries.append(Entry(f"lib/x86_64-linux-gnu/{lib.name}", "file", lib.read_bytes()))
    entries.append(
        Entry("lib64/ld-linux-x86-64.so.2", "symlink", target="/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2")
    )
    entries.append(Entry("usr/local/bin/cuda-probe", "file", (parts / "bin" / "cuda-probe").read_bytes()))
    driver = driver_file_sources(files)
    entries += [Entry(target, "file", Path(src).read_bytes()) for target, src in driver.items()]
    passwd = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"
    entries.append(Entry("etc/passwd", "file", passwd.encode(), mode=0o644))
    entries.append(Entry("etc/group", "file", b"root:x:0:\nnogroup:x:65534:\n", mode=0o644))
    config = {"Cmd": ["sh"], "Env": [PATH_ENV], "WorkingDir": "/"}
    return write_oci_archive(path, IMAGE, entries, config), driver


# --------------------------------------------------------------------------- the cluster


@dataclass
class H200Cluster:
    cp: ControlPlane
    api: Any
    nodes: Nodes
    node: Node
    slice_devices: dict[str, JSON]  # device name -> the published device
    image_driver_files: dict[str, str]
    host_network: bool
    pods: dict[str, JSON] = field(default_factory=dict)  # what the tests saw, for later ones

    @property
    def uuid(self) -> str:
        return str(self.slice_devices["gpu-0"]["attributes"]["uuid"]["string"])


@pytest.fixture(scope="module")
def h200(
    tmp_path_factory: pytest.TempPathFactory, driver_root: str, driver_files: DriverFiles, record: Recorder
) -> Iterator[H200Cluster]:
    parts = image_parts()
    if os.geteuid() != 0:
        pytest.skip("a real kubelet and containerd need root")
    profile = os.environ.get("HW_SIMULATE", "")
    spec = NodeSpec(NODE, profile, driver_args=("--driver-root", driver_root, "--memory-shares"))
    cp = ControlPlane.start(
        work_dir=tmp_path_factory.mktemp("h200-cluster"),
        node_lifecycle=True,
        extra_tokens=node_tokens([NODE]),
    )
    nodes: Nodes | None = None
    base = Path(os.environ.get("H200_NODES_DIR") or tmp_path_factory.mktemp("n", numbered=True))
    base.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.monotonic()
        nodes = Nodes.start(cp, [spec], base=base, keep_files=os.environ.get("DRA_NODE_KEEP") == "1")
        node = nodes[NODE]
        record(
            "node-started",
            "Nodes.start(cp, [NodeSpec('h200-node', NVML, --driver-root ... --memory-shares)])",
            json.dumps({k: round(v, 1) for k, v in nodes.timings.items()})
            + f"\nkubelet, containerd, driver: {node.kubelet_argv()[0]}, {node.bin_dir / 'containerd'}\n"
            + f"driver argv: {node.driver.proc.args if node.driver and node.driver.proc else '?'}",
        )
        archive, driver = probe_image(base / "images" / "probe.oci.tar", parts, driver_files)
        node.import_images({IMAGE: archive})
        record(
            "test-image",
            f"ctr -n k8s.io images import {archive.name}",
            f"{IMAGE}: {archive.stat().st_size} bytes; busybox, Debian glibc, /usr/local/bin/cuda-probe and "
            "these copies of the host driver's files:\n"
            + "\n".join(f"  /{t} <- {s} ({os.stat(s).st_size} bytes)" for t, s in driver.items()),
        )
        api = sync_client(str(cp.kubeconfig))
        devices = wait_for_slices(api, [node.driver] if node.driver else [])
        for path in device_class_files():
            applied = apply_documents(api, path, "default")
            assert not applied.problems, f"{path.name}: {applied.problems}"
        create_namespace(api, NAMESPACE)
        record("cluster-ready", "", f"{time.monotonic() - t0:.1f} s from node start to slices and classes")
        yield H200Cluster(
            cp=cp,
            api=api,
            nodes=nodes,
            node=node,
            slice_devices={name: d for (pool, name), d in devices.items() if pool == NODE},
            image_driver_files=driver,
            host_network=os.environ.get("H200_HOST_NETWORK") == "1",
        )
    finally:
        try:
            if nodes is not None:
                nodes.stop()
        finally:
            cp.stop(remove=False)


# --------------------------------------------------------------------------- pods


def probe_pod(name: str, host_network: bool, template: str | None = None, allocs: str = "") -> JSON:
    container: JSON = {
        "name": "main",
        "image": IMAGE,
        "command": ["sh", "-c", PROBE.replace("ALLOCS", allocs)],
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    spec: JSON = {
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 1,
        "restartPolicy": "Never",
        "hostNetwork": host_network,
        "securityContext": {"runAsUser": USER, "runAsGroup": USER, "runAsNonRoot": True},
        "containers": [container],
    }
    if template:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
        container["resources"] = {"claims": [{"name": "gpu"}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def claim_template(name: str, device_class: str, memory: str | None = None) -> JSON:
    exactly: JSON = {"deviceClassName": device_class}
    if memory:
        exactly["capacity"] = {"requests": {"memory": memory}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
    }


def pod_log(node: Node, pod: JSON, timeout: float = 120.0) -> str:
    """The container's output up to the `--- end` marker, from the kubelet's CRI log file."""
    meta = pod["metadata"]
    path = node.pod_logs_dir / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / "main" / "0.log"
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        if path.exists():
            # CRI log lines: "<time> stdout F <text>"
            lines = [
                ln.split(" ", 3)[3] if ln.count(" ") >= 3 else "" for ln in path.read_text().splitlines()
            ]
            text = "\n".join(lines)
            if "--- end" in text:
                return text
        time.sleep(0.2)  # the poll interval
    raise AssertionError(f"no `--- end` in {path} after {timeout}s; so far:\n{text}")


def sections(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in re.split(r"^--- ", text, flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        out[title.strip()] = body.strip()
    return out


def probe_json(section: str) -> JSON:
    line = next((ln for ln in section.splitlines() if ln.startswith("{")), None)
    assert line is not None, f"cuda-probe printed no JSON:\n{section}"
    result: JSON = json.loads(line)
    return result


def file_ids(section: str) -> dict[str, tuple[int, int] | None]:
    out: dict[str, tuple[int, int] | None] = {}
    for line in section.splitlines():
        path, _, rest = line.partition(" ")
        nums = rest.split()
        out[path] = (
            (int(nums[0]), int(nums[1])) if len(nums) == 2 and all(n.isdigit() for n in nums) else None
        )
    return out


def host_ids(paths: dict[str, str]) -> dict[str, tuple[int, int]]:
    """Container path (with a leading slash) -> (st_dev, st_ino) of the host's driver-root file."""
    out = {}
    for target, src in paths.items():
        st = os.stat(src)
        out["/" + target] = (st.st_dev, st.st_ino)
    return out


def run_pod(h: H200Cluster, pod: JSON, record: Recorder, title: str) -> tuple[JSON, dict[str, str]]:
    """Create the pod (remembered in `h.pods` at once, for cleanup), wait for its output."""
    name = pod["metadata"]["name"]
    h.pods[name] = create_object(h.api, pod, NAMESPACE)
    obj = wait_running(h.api, NAMESPACE, name, timeout=90)
    text = pod_log(h.node, obj)
    record(title, f"kubectl logs -n {NAMESPACE} {name}   # command: sh -c '<PROBE>' as uid {USER}", text)
    return obj, sections(text)


def remove_pods(h: H200Cluster, names: list[str]) -> None:
    """Delete these pods where they were created, and wait until they are gone."""
    created = [n for n in names if h.pods.pop(n, None) is not None]
    for name in created:
        delete_pod(h.api, NAMESPACE, name)
    for name in created:
        wait_gone(h.api, NAMESPACE, name)


def cdi_listing(node: Node) -> list[str]:
    return sorted(p.name for p in node.cdi_dir.iterdir())


def gpu_lines(smi_section: str) -> list[str]:
    return [ln for ln in smi_section.splitlines() if ln.startswith("GPU ")]


# --------------------------------------------------------------------------- tests


def test_slice_publishes_this_gpu(h200: H200Cluster, driver_root: str, record: Recorder) -> None:
    query = [smi(driver_root), "--query-gpu=uuid,name,memory.total", "--format=csv,noheader,nounits"]
    host = run(query)
    device = h200.slice_devices["gpu-0"]
    attrs = device["attributes"]
    record(
        "slice",
        f"GET {RESOURCE_API}/resourceslices?fieldSelector=spec.nodeName={NODE}   (device gpu-0, shortened)",
        json.dumps(
            {
                "name": "gpu-0",
                "uuid": attrs["uuid"],
                "productName": attrs.get("productName"),
                "capacity": device.get("capacity"),
                "all devices": sorted(h200.slice_devices),
            },
            indent=1,
        ),
    )
    record("host-nvidia-smi", query, host.stdout + host.stderr)
    assert host.returncode == 0, host.stderr
    uuids = [line.split(",")[0].strip() for line in host.stdout.splitlines() if line.strip()]
    assert uuids == [h200.uuid], f"the slice's gpu-0 is {h200.uuid}; this host's GPUs: {uuids}"


def test_claim_pod_sees_exactly_the_published_gpu(h200: H200Cluster, record: Recorder) -> None:
    create_object(h200.api, claim_template("one-gpu", DRIVER), NAMESPACE)
    pod, out = run_pod(h200, probe_pod("gpu-pod", h200.host_network, template="one-gpu"), record, "claim-pod")
    claim = next(iter(pod_claims(h200.api, pod).values()))
    results = claim["status"]["allocation"]["devices"]["results"]
    spec_files = cdi_specs_of(h200.node, claim["metadata"]["uid"])
    record(
        "claim-pod-allocation",
        f"kubectl get resourceclaim -n {NAMESPACE} {claim['metadata']['name']}; ls <cdi dir>",
        json.dumps({"results": results, "cdi specs": [p.name for p in spec_files]}, indent=1)
        + "\n"
        + "\n".join(p.read_text() for p in spec_files)[:3000],
    )
    assert [(r["driver"], r["pool"], r["device"]) for r in results] == [(DRIVER, NODE, "gpu-0")]
    assert len(spec_files) == 1, "the claim's CDI spec must exist while the pod runs"

    assert f"uid={USER}" in out["id"], out["id"]
    assert gpu_lines(out["nvidia-smi -L"]) == [f"GPU 0: NVIDIA H200 (UUID: {h200.uuid})"], out[
        "nvidia-smi -L"
    ]
    probe = probe_json(out["cuda-probe"])
    assert probe["uid"] == USER
    assert probe["device_count"] == 1, probe
    assert [d["uuid"] for d in probe["devices"]] == [h200.uuid], probe
    assert probe.get("axpy_ok") is True, probe

    # The programs that ran came from the spec's bind mounts of the driver root, not the image.
    ids = host_ids(h200.image_driver_files)
    seen = file_ids(out["files"])
    assert seen.get("/usr/bin/nvidia-smi") == ids["/usr/bin/nvidia-smi"], (seen, ids)
    lib = f"/{LIB_DIR}/libcuda.so.1"
    assert seen.get(lib) == ids[lib], (seen, ids)
    assert tuple(probe["libcuda"][1:]) == ids[lib], probe["libcuda"]


def test_pod_without_a_claim_sees_no_gpu(h200: H200Cluster, record: Recorder) -> None:
    _, out = run_pod(h200, probe_pod("no-claim-pod", h200.host_network), record, "no-claim-pod")
    try:
        assert f"uid={USER}" in out["id"], out["id"]
        assert "/dev/nvidia" not in out["devices"].replace("/dev/nvidia*", ""), out["devices"]
        assert gpu_lines(out["nvidia-smi -L"]) == [], out["nvidia-smi -L"]
        probe = probe_json(out["cuda-probe"])
        assert probe["device_count"] == 0, probe
        # The image's own copies ran: the same programs, yet no GPU.
        ids = host_ids(h200.image_driver_files)
        seen = file_ids(out["files"])
        assert seen.get("/usr/bin/nvidia-smi") not in (None, ids["/usr/bin/nvidia-smi"]), (seen, ids)
        if "libcuda" in probe:
            assert tuple(probe["libcuda"][1:]) != ids[f"/{LIB_DIR}/libcuda.so.1"], probe
    finally:
        remove_pods(h200, ["no-claim-pod"])


def test_pod_delete_unprepares_and_removes_the_spec(h200: H200Cluster, record: Recorder) -> None:
    if "gpu-pod" not in h200.pods:
        pytest.fail("the claim pod of the earlier test was not created")
    claim = next(iter(pod_claims(h200.api, get_pod(h200.api, NAMESPACE, "gpu-pod")).values()))
    uid = claim["metadata"]["uid"]
    t0 = time.monotonic()
    remove_pods(h200, ["gpu-pod"])
    wait_for("the claim's CDI spec to go", lambda: not cdi_specs_of(h200.node, uid), timeout=60)
    seconds = time.monotonic() - t0
    driver_log = h200.node.driver.log_tail(10**7) if h200.node.driver else ""
    unprepares = [ln for ln in driver_log.splitlines() if uid in ln and '"unprepared"' in ln]
    record(
        "delete-unprepare",
        f"kubectl delete pod -n {NAMESPACE} gpu-pod; ls <cdi dir>; the driver's 'unprepared' line",
        f"pod gone and spec removed after {seconds:.1f} s; CDI dir now: {cdi_listing(h200.node)}\n"
        + "\n".join(unprepares[-5:]),
    )
    assert unprepares, "the driver logged no Unprepare of the claim"


def test_memory_shares_run_under_their_own_limits(h200: H200Cluster, record: Recorder) -> None:
    """Two pods with memory shares of 10Gi and 20Gi on the one GPU, each under its own MPS
    limit: 5 GiB fits both, 15 GiB only the 20Gi share, 25 GiB neither."""
    if "gpu-0-share" not in h200.slice_devices:
        pytest.skip("the driver publishes no share view (no --memory-shares)")
    shares = {"share-10": "10Gi", "share-20": "20Gi"}
    for name, memory in shares.items():
        create_object(h200.api, claim_template(name, SHARE_CLASS, memory), NAMESPACE)
    try:
        outs = {}
        for name in shares:
            pod, out = run_pod(
                h200,
                probe_pod(name, h200.host_network, template=name, allocs="5 15 25"),
                record,
                f"{name}-pod",
            )
            claim = next(iter(pod_claims(h200.api, pod).values()))
            outs[name] = (
                claim["status"]["allocation"]["devices"]["results"],
                probe_json(out["cuda-probe"]),
                out,
            )
        record(
            "share-allocations",
            "allocation results of the two share claims",
            json.dumps({n: r for n, (r, _, _) in outs.items()}, indent=1),
        )
        for results, probe, out in outs.values():
            assert [r["device"] for r in results] == ["gpu-0-share"], results
            assert gpu_lines(out["nvidia-smi -L"]) == [f"GPU 0: NVIDIA H200 (UUID: {h200.uuid})"], out
            assert [d["uuid"] for d in probe["devices"]] == [h200.uuid], probe
            assert probe.get("axpy_ok") is True, probe
        assert outs["share-10"][1]["allocs"] == {
            "5": "ok",
            "15": "CUDA_ERROR_OUT_OF_MEMORY",
            "25": "CUDA_ERROR_OUT_OF_MEMORY",
        }, outs["share-10"][1]
        assert outs["share-20"][1]["allocs"] == {"5": "ok", "15": "ok", "25": "CUDA_ERROR_OUT_OF_MEMORY"}, (
            outs["share-20"][1]
        )
    finally:
        remove_pods(h200, list(shares))
        left = sync_request(h200.api, "GET", f"{RESOURCE_API}/namespaces/{NAMESPACE}/resourceclaims")["items"]
        record(
            "after-shares",
            "claims left in the namespace; CDI dir",
            f"{[c['metadata']['name'] for c in left]}; {cdi_listing(h200.node)}",
        )


def test_nothing_is_left(h200: H200Cluster, record: Recorder) -> None:
    """After the tests above: no pod in the namespace, no claim spec in the CDI dir."""
    pods = sync_request(h200.api, "GET", f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
    assert not pods, [describe(h200.api, NAMESPACE, p["metadata"]["name"]) for p in pods]
    wait_for("every claim's CDI spec to go", lambda: not list(h200.node.cdi_dir.glob("*.json")), timeout=60)
