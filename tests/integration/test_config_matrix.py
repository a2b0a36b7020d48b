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

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from dra_driver.cdi.builders import DEVICE_ENV_PREFIX, device_env_name
from dra_driver.sharing.mps.settings import CONTAINER_PIPE_DIR
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER
from tests.harness.driver_image import CHART, build_helm
from tests.harness.fake_mps import mps_driver_root
from tests.harness.kubelet import ClaimName
from tests.harness.objects import (
    RESOURCE_API,
    api_error,
    get_claim,
    get_pod,
    pinned_pod,
    scheduler_reason,
    sync_request,
    wait_for,
)
from tests.harness.pinned_claims import Bench
from tests.harness.plugin_node import plugin_node

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
CELLS = [(kind, config) for kind in KINDS for config in CONFIGS]
# What to change, in a refusal: the message must say one of these.
FIXES = ("use kind", "remove", "set strategy", "ask for", "write", "use one of", "must be")


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
            ("--driver-root", str(mps_driver_root(base / "driver")), "--dynamic-mig", "--memory-shares"),
        ) as n:
            yield Bench(api, control_plane, n.plugin, n.side, NODE)
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


def _create_cell(
    api: client.ApiClient, ns: str, name: str, kind: str, config_name: str, dry_run: bool = False
) -> str | None:
    """The cell's claim and pod, both called `name` (with `dry_run`: neither, only the API
    server's answer); the refusal at creation, if any."""
    try:
        sync_request(
            api,
            "POST",
            f"{RESOURCE_API}/namespaces/{ns}/resourceclaims",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name},
                "spec": {"devices": _devices(kind, CONFIGS[config_name])},
            },
            query={"dryRun": "All"} if dry_run else None,
        )
    except ApiException as e:
        return api_error(e).split("denied request: ", 1)[-1]
    if not dry_run:
        _create_pod(api, ns, name)
    return None


def _create_pod(api: client.ApiClient, ns: str, name: str) -> None:
    sync_request(api, "POST", f"/api/v1/namespaces/{ns}/pods", pinned_pod(name, NODE, name))


def _bound(api: client.ApiClient, ns: str, name: str) -> dict[str, Any] | None:
    """The cell's claim once its pod is bound; None if the pod stays unscheduled."""
    try:
        wait_for("the cell's pod bound", lambda: get_pod(api, ns, name)["spec"].get("nodeName"), timeout=30)
    except TimeoutError:
        return None
    return get_claim(api, ns, name)


def _outcome(bench: Bench, ns: str, kind: str, config_name: str, name: str) -> tuple[str, str]:
    """("runs" | "refused" | "STUCK", what happened) for one cell."""
    api = bench.api
    refusal = _create_cell(api, ns, name, kind, config_name)
    if refusal is not None:
        return "refused", refusal
    claim = _bound(api, ns, name)
    if claim is None:
        return "STUCK", f"admitted but never allocated: {scheduler_reason(api, ns, name)}"
    ref = ClaimName(ns, name, claim["metadata"]["uid"])
    answer = bench.kubelet.prepare(ref).claims[ref.uid]
    try:
        if answer.error:
            return "STUCK", f"admitted and allocated, then refused by the plugin: {answer.error}"
        wrong = _not_as_asked(bench, kind, config_name, claim, answer)
        if wrong:
            return "STUCK", f"prepared without what it asked: {wrong}"
        limit = next((e for e in _cdi(bench, answer)[0] if e.startswith(f"{LIMIT_ENV}=")), "")
        return "runs", _device(claim) + (f", MPS limit {limit.split('=', 1)[1]}" if limit else "")
    finally:
        bench.kubelet.unprepare(ref)


LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"


def _device(claim: dict[str, Any]) -> str:
    device: str = claim["status"]["allocation"]["devices"]["results"][0]["device"]
    return device


def _expected_limit(kind: str, config_name: str) -> str | None:
    """The MPS client limit a cell asks for: its config's 4Gi, else a share's own 8Gi."""
    if "MPS" in config_name:
        return "0=4G"
    return "0=8G" if kind == "memory share" else None


def _not_as_asked(bench: Bench, kind: str, config_name: str, claim: dict[str, Any], answer: Any) -> str:
    """What the prepared cell's containers would get that its own claim did not ask for
    (read from its CDI spec with cdicheck, as a runtime applies it); "" if nothing."""
    env, mounts = _cdi(bench, answer)
    uid = claim["metadata"]["uid"]
    wants_mps = kind == "memory share" or "MPS" in config_name
    has_mps = any(e.startswith(f"{PIPE_ENV}=") for e in env)
    if wants_mps != has_mps:
        return f"MPS asked {wants_mps}, given {has_mps}"
    limit = next((e.split("=", 1)[1] for e in env if e.startswith(f"{LIMIT_ENV}=")), None)
    if limit != _expected_limit(kind, config_name):
        return f"MPS limit {_expected_limit(kind, config_name)} asked, {limit} given"
    pipes = [m["source"] for m in mounts if m["destination"] == CONTAINER_PIPE_DIR]
    if any(uid not in source for source in pipes):
        return f"the MPS pipe directory {pipes} is not this claim's ({uid})"
    named = sorted(e.split("=", 1)[0] for e in env if e.startswith(DEVICE_ENV_PREFIX))
    if named != [device_env_name(_device(claim))]:
        return f"device variables {named} for allocated device {_device(claim)}"
    return ""


def _cdi(bench: Bench, answer: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """The environment and mounts the runtime would give a container with the answer's devices."""
    env: list[str] = []
    mounts: list[dict[str, Any]] = []
    for device in answer.devices:
        proc = subprocess.run(
            [_CDICHECK[0], "-dir", str(bench.plugin.cdi_dir), *device.cdi_device_ids],
            capture_output=True,
            text=True,
            check=True,
        )
        oci = json.loads(proc.stdout)
        env += oci["process"]["env"]
        mounts += oci.get("mounts") or []
    return env, mounts


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
    for n, (kind, config_name) in enumerate(CELLS):
        try:
            # a name of its own: test_reused_names_* says why a reused one is another test
            outcome, detail = _outcome(bench, namespace, kind, config_name, f"cell-{n}")
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
    _create_pod(api, namespace, "all")
    try:
        wait_for("the pod bound", lambda: get_pod(api, namespace, "all")["spec"].get("nodeName"), timeout=30)
        results = get_claim(api, namespace, "all")["status"]["allocation"]["devices"]["results"]
        assert sorted(r["device"] for r in results) == ["gpu-2"]
    finally:
        _clear(api, namespace)


# ------------------------------------------------------------------ one name, reused (issue 55)

STRESS_ROUNDS = int(os.environ.get("STRESS_ROUNDS", "2"))
DEVICE_OF_KIND = {  # what each kind is given on this node
    "whole GPU": "gpu-2",
    "static MIG": "gpu-1-mig-",
    "dynamic MIG slice": "gpu-0-mig-",
    "memory share": "gpu-2-share",
}
# what each kind's class selects on this node (the static MIG class, mig.<driver>, selects
# dynamic slices too: the static cells' own selector, "uuid" in attributes, keeps them out)
DEVICES_OF_CLASS = {
    "whole GPU": ("gpu-2",),
    "static MIG": ("gpu-1-mig-", "gpu-0-mig-"),
    "dynamic MIG slice": ("gpu-0-mig-",),
    "memory share": ("gpu-2-share",),
}
FOREIGN = "allocation was made for another claim"


def _is(device: str, patterns: tuple[str, ...]) -> bool:
    return any(device.startswith(p) if p.endswith("-") else device == p for p in patterns)


def _own_devices(kind: str, claim: dict[str, Any]) -> bool:
    return _is(_device(claim), (DEVICE_OF_KIND[kind],))


def _own_configs(claim: dict[str, Any]) -> bool:
    """The allocation's FromClaim configs are the claim's own (compared as the test wrote them)."""
    own = [c["opaque"] for c in claim["spec"]["devices"].get("config") or []]
    allocated = claim["status"]["allocation"]["devices"].get("config") or []
    return [c["opaque"] for c in allocated if c["source"] == "FromClaim"] == own


def _paused(pid: int) -> contextlib.AbstractContextManager[None]:
    """kube-scheduler stopped (SIGSTOP) for the block: its informers then see what the block
    did only after it, as a loaded scheduler does."""

    @contextlib.contextmanager
    def pause() -> Iterator[None]:
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    return pause()


def test_reused_names_in_random_order_get_exactly_their_own_sharing(
    bench: Bench, namespace: str, control_plane: ControlPlane
) -> None:
    """The matrix's cells in random order, STRESS_ROUNDS times, all named `cell` in one
    namespace; the previous cell's Unprepare races the next one's Prepare, as a kubelet
    tearing one pod down while starting the next. Every prepared cell must get exactly
    the sharing its own claim asks (MPS or not, its limit, its pipe directory) on a device
    of its class.

    Three in four cells re-create the claim while kube-scheduler is paused, after the old claim
    was deallocated (its pod gone) and before it was deleted: the scheduler then still
    sees the old claim under the name, allocates for it and writes that allocation onto
    the new claim (issue 55: how a claim that asked for nothing once got MPS). Such a
    cell must be refused by the plugin, naming why, and only where the allocation really
    is the old claim's; once its pod is deleted the claim is allocated anew and its next
    pod runs exactly as asked. What the plugin cannot see is counted, not failed: the old
    claim's device where both claims name one class and the same configs and only the new
    claim's CEL selector would refuse it (a static MIG cell given a dynamic slice), which
    only the scheduler evaluates (docs/node-state.md)."""
    _CDICHECK[:] = [str(control_plane.bin_dir / "cdicheck")]
    seed = int(os.environ.get("STRESS_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    cells = CELLS * STRESS_ROUNDS
    rng.shuffle(cells)
    api, side, scheduler = bench.api, bench.kubelet, control_plane.processes["kube-scheduler"].pid
    claims = f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims"
    wrong: list[str] = []
    seen: Counter[str] = Counter()
    previous: ClaimName | None = None

    def deallocated() -> bool:
        claim = get_claim(api, namespace, "cell")
        return not claim["status"].get("allocation") and not claim["metadata"].get("finalizers")

    def gone() -> bool:
        return not sync_request(api, "GET", claims)["items"]

    with ThreadPoolExecutor(2) as pool:
        for kind, config_name in cells:
            cell = f"{kind} x {config_name}"
            if _create_cell(api, namespace, "probe", kind, config_name, dry_run=True) is not None:
                seen["refused at creation"] += 1  # the matrix checks the refusals
                continue
            if previous is not None:
                sync_request(api, "DELETE", f"/api/v1/namespaces/{namespace}/pods/cell",
                             query={"gracePeriodSeconds": "0"})
                wait_for("the previous claim deallocated", deallocated, timeout=60)
            pause = previous is not None and rng.random() < 0.75
            if pause:
                time.sleep(0.5)  # the scheduler sees the old claim deallocated, not deleted
            with _paused(scheduler) if pause else contextlib.nullcontext():
                if previous is not None:
                    sync_request(api, "DELETE", f"{claims}/cell")
                    wait_for("the previous claim gone", gone, timeout=60)
                refusal = _create_cell(api, namespace, "cell", kind, config_name)
            if refusal is not None:
                wrong.append(f"{cell}: refused at creation, though a dry run was admitted: {refusal}")
                break
            claim = _bound(api, namespace, "cell")
            if claim is None:
                why = scheduler_reason(api, namespace, "cell")
                wrong.append(f"{cell}: admitted but never allocated: {why}")
                break
            ref = ClaimName(namespace, "cell", claim["metadata"]["uid"])
            released = pool.submit(side.unprepare, previous) if previous is not None else None
            answer = pool.submit(side.prepare, ref).result().claims[ref.uid]
            if released is not None:
                released.result()
                if answer.error and f"(uid {previous.uid})" in answer.error:  # type: ignore[union-attr]
                    seen["retried after the previous claim's unprepare"] += 1  # as the kubelet retries
                    answer = side.prepare(ref).claims[ref.uid]
            previous = ref
            if answer.error and FOREIGN in answer.error:
                if _own_devices(kind, claim) and _own_configs(claim):
                    wrong.append(f"{cell}: refused as another claim's allocation, but it is its own: "
                                 f"{answer.error}")
                    continue
                seen["given the old claim's allocation, refused"] += 1
                sync_request(api, "DELETE", f"/api/v1/namespaces/{namespace}/pods/cell",
                             query={"gracePeriodSeconds": "0"})
                wait_for("the claim deallocated", deallocated, timeout=60)
                _create_pod(api, namespace, "cell")
                claim = _bound(api, namespace, "cell") or {}
                answer = side.prepare(ref).claims[ref.uid] if claim else answer
            if answer.error:
                wrong.append(f"{cell}: refused by the plugin: {answer.error}")
                continue
            seen["prepared"] += 1
            problem = _not_as_asked(bench, kind, config_name, claim, answer)
            if not _is(_device(claim), DEVICES_OF_CLASS[kind]):
                problem = f"given {_device(claim)}, not a device of its class"
            elif not _own_devices(kind, claim):  # what only the class's and its selectors tell
                seen["given a device its selectors exclude (the scheduler's race, docs/node-state.md)"] += 1
            if problem:
                wrong.append(f"{cell}: {problem}")
        if previous is not None:
            side.unprepare(previous)
    _clear(api, namespace)
    print(f"\nseed {seed}, {len(cells)} cells: " + ", ".join(f"{n} {w}" for w, n in sorted(seen.items())))
    assert not wrong, f"seed {seed} (STRESS_SEED={seed} repeats it):\n" + "\n".join(wrong)
    assert seen["prepared"] >= len(cells) // 2, seen
