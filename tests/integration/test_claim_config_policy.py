"""Claim configs against the real API server and scheduler: NVIDIA's form
(resource.nvidia.com/v1beta1) and ours accepted at admission and prepared as asked; what the
plugin would refuse refused when written, by the chart's claim-config policy, with the
plugin's own message, in a claim, a template or a DeviceClass (whose config every claim of
the class gets); a request for NVIDIA's VFIO class under this driver's domain (NVIDIA's
VFIO examples after docs/migrating.md's sed) refused when written, since no such class
exists here; a claim or class written before the policy took effect never stuck by it.

One `dra-driver kubelet-plugin` on a simulated a100-mig box (whole A100s gpu-0..3, MIG
devices on the others) with a stand-in `nvidia-cuda-mps-control` (tests/harness/fake_mps.py)
under its driver root. The policy is the chart's template as `helm template` renders it.
Claims are used by pods pinned to the node; the kubelet's side of Prepare is
tests/harness/kubelet.py and each CDI id is resolved by `cdicheck` (the CDI library
containerd uses), so the settings checked are what a container would get.
"""

from __future__ import annotations

import json
import os
import re
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

from dra_driver.jsontypes import JSON
from dra_driver.sharing.config import ConfigError
from dra_driver.sharing.nvidia_config import NVIDIA_ONLY_KINDS, parse_claim_config
from tests.harness.bodies import claim_body, claim_pod
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER
from tests.harness.driver_image import render_chart
from tests.harness.fake_mps import mps_driver_root
from tests.harness.nvidia_reference import nvidia_source
from tests.harness.objects import (
    RESOURCE_API,
    allocation_results,
    api_error,
    create_device_class,
    get_claim,
    get_pod,
    load_yaml_documents,
    policy_denial,
    scheduler_reason,
    sync_request,
    wait_for,
)
from tests.harness.pinned_claims import Bench as PinnedBench
from tests.harness.pinned_claims import Case as PinnedCase
from tests.harness.pinned_claims import cdi_edits, oci_env
from tests.harness.plugin_node import plugin_node

ADMISSION_API = "/apis/admissionregistration.k8s.io/v1"
SLICES = f"{RESOURCE_API}/resourceslices"
EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "nvidia"
SUFFIX = uuid.uuid4().hex[:6]
NODE = f"cfg-{SUFFIX}"
GPU_CLASS = f"cfg-gpu-{SUFFIX}"
MIG_CLASS = f"cfg-mig-{SUFFIX}"
NV = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
OURS = {"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig"}


@dataclass
class Bench(PinnedBench):
    """tests/harness/pinned_claims.py's bench, with the chart's admission policy as rendered."""

    policy: list[JSON]


def _rendered_policy(tmp: Path) -> list[JSON]:
    docs = render_chart(tmp, show_only="templates/claim-config-policy.yaml")
    # the claim-config policy and the class-config one (claims beside each class's config), each bound
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ValidatingAdmissionPolicy"] * 2 + ["ValidatingAdmissionPolicyBinding"] * 2
    return docs


def _admission_path(doc: JSON, name: bool = False) -> str:
    plural = {
        "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
        "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
    }[doc["kind"]]
    return f"{ADMISSION_API}/{plural}" + (f"/{doc['metadata']['name']}" if name else "")


def _device_class(name: str, parameters: Any, selector: str | None = None) -> JSON:
    spec: JSON = {"config": [{"opaque": {"driver": DRIVER, "parameters": parameters}}]}
    if selector is not None:
        spec["selectors"] = [{"cel": {"expression": selector}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
            "spec": spec}


def _one_request(parameters: Any, cls: str = GPU_CLASS, count: int = 1) -> JSON:
    return {
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": cls, "count": count}}],
        "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}],
    }


def _policy_in_effect(api: client.ApiClient, namespace: str) -> None:
    probe = claim_body("probe", _one_request({**NV, "kind": "VfioDeviceConfig"}))
    wait_for("the claim-config policy to take effect",
             lambda: policy_denial(api, namespace, probe, dry_run=True))


@pytest.fixture(scope="module")
def bench(control_plane: ControlPlane, api: client.ApiClient) -> Iterator[Bench]:
    base = Path(tempfile.mkdtemp(prefix="cfg-", dir="/tmp"))  # short: UNIX socket paths
    base.chmod(0o755)  # MPS servers run as the client's user and must reach the pipe dirs
    policy = _rendered_policy(base / "helm")
    for doc in policy:
        sync_request(api, "POST", _admission_path(doc), doc)
    for name, kind in ((GPU_CLASS, "gpu"), (MIG_CLASS, "mig")):
        create_device_class(
            api, name, f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "{kind}"'
        )
    try:
        with plugin_node(
            api,
            control_plane.kubeconfig,
            NODE,
            "a100-mig",
            base / "n",
            ("--driver-root", str(mps_driver_root(base / "driver"))),
        ) as n:
            yield Bench(api, control_plane, n.plugin, n.side, NODE, policy)
    finally:
        for name in (GPU_CLASS, MIG_CLASS):
            sync_request(api, "DELETE", f"{RESOURCE_API}/deviceclasses/{name}")
        for doc in reversed(policy):
            try:
                sync_request(api, "DELETE", _admission_path(doc, name=True))
            except ApiException as e:
                if e.status != 404:
                    raise
        if not os.environ.get("KEEP_TMP"):
            shutil.rmtree(base, ignore_errors=True)


class Case(PinnedCase):
    """tests/harness/pinned_claims.py's case, with a container per request."""

    def pod(self, name: str, claim: JSON, requests: list[str]) -> None:
        """A pod with one container per request, pinned to the node."""
        pod = claim_pod(name, claim, NODE, requests)
        sync_request(self.api, "POST", f"/api/v1/namespaces/{self.ns}/pods", pod)

    def create(self, devices: JSON) -> str:
        name = f"c{next(self.counter)}"
        sync_request(
            self.api, "POST", f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims", claim_body(name, devices)
        )
        self.pod(name, {"resourceClaimName": name}, [r["name"] for r in devices["requests"]])
        return name

    def claim_of(self, pod: str) -> JSON:
        """The pod's one claim once the pod is bound."""

        def probe() -> JSON | None:
            status = get_pod(self.api, self.ns, pod).get("status", {})
            if not get_pod(self.api, self.ns, pod)["spec"].get("nodeName"):
                return None
            names = status.get("resourceClaimStatuses") or []
            return {"name": names[0]["resourceClaimName"]} if names else {"name": pod}

        try:
            found = wait_for(f"pod {pod} bound", probe, timeout=30)
        except TimeoutError as e:
            raise AssertionError(f"{e}; scheduler says: {scheduler_reason(self.api, self.ns, pod)}") from e
        return get_claim(self.api, self.ns, found["name"])

    def env_by_request(self, claim: JSON) -> dict[str, dict[str, str]]:
        """Each request's container environment, from the CDI ids the plugin answered."""
        answer = self.prepare_claim(claim)
        assert not answer.error, answer.error
        out: dict[str, dict[str, str]] = {}
        for device in answer.devices:
            env = oci_env(cdi_edits(self.bench, device.cdi_device_ids))
            for request in device.request_names:
                out[request] = env
        return out


@pytest.fixture
def case(bench: Bench, namespace: str) -> Iterator[Case]:
    with Case(bench, namespace) as c:
        yield c


def _mps(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("CUDA_MPS_")}


def _plugin_message(parameters: Any) -> str:
    try:
        parse_claim_config(parameters, DRIVER, "opaque.parameters")
    except ConfigError as e:
        return str(e)
    raise AssertionError(f"the plugin accepts {parameters}")


# --------------------------------------------------------------------------- accepted and prepared


def test_nvidia_quickstart_mps_example_runs_with_its_limits(case: Case) -> None:
    template, pod = load_yaml_documents(EXAMPLES / "13-nvidia-mps.yaml")
    devices = template["spec"]["spec"]["devices"]
    devices["requests"][0]["exactly"]["deviceClassName"] = GPU_CLASS
    sync_request(case.api, "POST", f"{RESOURCE_API}/namespaces/{case.ns}/resourceclaimtemplates", template)
    case.pod("mps", {"resourceClaimTemplateName": template["metadata"]["name"]}, ["mps-gpu", "mps-gpu"])
    env = case.env_by_request(case.claim_of("mps"))
    assert _mps(env["mps-gpu"]) == {
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10G",
    }
    assert pod["spec"]["containers"][0]["resources"]["claims"][0]["request"] == "mps-gpu"


def test_nvidia_quickstart_time_sliced_and_mps_gpus_in_one_claim(case: Case) -> None:
    template, _ = load_yaml_documents(EXAMPLES / "14-nvidia-time-slicing-and-mps.yaml")
    for request in template["spec"]["spec"]["devices"]["requests"]:
        request["exactly"]["deviceClassName"] = GPU_CLASS
    sync_request(case.api, "POST", f"{RESOURCE_API}/namespaces/{case.ns}/resourceclaimtemplates", template)
    case.pod("ts-mps", {"resourceClaimTemplateName": template["metadata"]["name"]}, ["ts-gpu", "mps-gpu"])
    env = case.env_by_request(case.claim_of("ts-mps"))
    assert _mps(env["ts-gpu"]) == {}  # the time-sliced GPU: nothing hides it behind the daemon
    assert _mps(env["mps-gpu"])["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert _mps(env["mps-gpu"])["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10G"


def test_nvidia_per_device_limits_by_index_override_the_default(case: Case) -> None:
    parameters = {
        **NV,
        "sharing": {
            "strategy": "MPS",
            "mpsConfig": {
                "defaultPinnedDeviceMemoryLimit": "10Gi",
                "defaultPerDevicePinnedMemoryLimit": {"1": "4Gi"},
            },
        },
    }
    dry = claim_body("dry", _one_request(parameters, count=2))
    assert policy_denial(case.api, case.ns, dry, dry_run=True) is None
    name = case.create(_one_request(parameters, count=2))
    env = case.env_by_request(case.claim_of(name))
    assert _mps(env["gpu"])["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10G,1=4G"


def test_nvidia_mig_device_config_with_mps(case: Case) -> None:
    parameters = {
        **NV,
        "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 25}},
    }
    name = case.create(_one_request(parameters, cls=MIG_CLASS))
    env = case.env_by_request(case.claim_of(name))
    assert _mps(env["gpu"])["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


def test_our_own_config_is_prepared_as_before(case: Case) -> None:
    parameters = {**OURS, "sharing": {"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "2Gi"}}}
    name = case.create(_one_request(parameters))
    env = case.env_by_request(case.claim_of(name))
    assert _mps(env["gpu"])["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2G"


# What `kubectl create` leaves once a field's only setting is removed (docs/migrating.md's
# `interval`): null or {}; NVIDIA's driver reads each as its default, and so does this one.
NULL_OR_EMPTY = [
    {**NV, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": None}},
    {**NV, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": None}}},
    {**NV, "sharing": {"strategy": "TimeSlicing", "mpsConfig": None}},
    {**NV, "sharing": {"strategy": "MPS", "timeSlicingConfig": None, "mpsConfig": None}},
    {**OURS, "sharing": None},
    {**OURS, "sharing": {"strategy": "MPS", "mps": None}},
    {**OURS, "sharing": {"strategy": "TimeSlicing", "mps": None}},
]


@pytest.mark.parametrize("parameters", NULL_OR_EMPTY, ids=lambda p: json.dumps(p["sharing"]))
def test_a_null_or_empty_object_is_taken_as_its_default_when_written(
    bench: Bench, namespace: str, parameters: JSON
) -> None:
    claim = claim_body("empty", _one_request(parameters))
    assert policy_denial(bench.api, namespace, claim, dry_run=True) is None
    parse_claim_config(parameters, DRIVER, "opaque.parameters")  # and by the plugin


def test_a_time_slicing_config_left_null_is_prepared_as_the_default(case: Case) -> None:
    parameters = {**NV, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": None}}
    name = case.create(_one_request(parameters))
    env = case.env_by_request(case.claim_of(name))
    assert _mps(env["gpu"]) == {}


# --------------------------------------------------------------------------- refused when written


REFUSED = [
    {**NV, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}},
    {**NV, "kind": "VfioDeviceConfig"},
    # NVIDIA's kinds as its users write them: refused for the kind, not for its fields
    {**NV, "kind": "VfioDeviceConfig", "iommu": {"backendPolicy": "LegacyOnly", "enableAPIDevice": True}},
    {**NV, "kind": "ComputeDomainChannelConfig", "domainID": "4f1b", "allocationMode": "All"},
    {**NV, "sharing": {"strategy": "MPS", "mpsConfig": {"multiUser": True}}},
    {**NV, "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}},
    {
        **NV,
        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"first": "1Gi"}}},
    },
    {**NV, "sharing": {"strategy": "TimeSlicing", "mpsConfig": {}}},
    {**NV, "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS", "timeSlicingConfig": {}}},
    {**NV, "sharing": {"strategy": "MPS", "mpsConfig": {"pinned": "1Gi"}}},
    {**OURS, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}},
    {**OURS, "sharing": {"strategy": "MPX"}},
    {**OURS, "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 150}}},
    {**OURS, "sharing": {"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "512Ki"}}},
    {**OURS, "kind": "GPUConfig"},
    {**OURS, "apiVersion": f"{DRIVER}/v1"},
]


@pytest.mark.parametrize("parameters", REFUSED, ids=lambda p: json.dumps(p, separators=(",", ":"))[40:110])
def test_what_the_plugin_refuses_is_refused_when_written_with_its_message(
    bench: Bench, namespace: str, parameters: JSON
) -> None:
    expected = _plugin_message(parameters)
    claim = claim_body("refused", _one_request(parameters))
    message = policy_denial(bench.api, namespace, claim)
    assert message is not None and expected.endswith(message) and message.startswith("opaque.parameters"), (
        f"policy: {message}\nplugin: {expected}"
    )
    if parameters.get("kind") in NVIDIA_ONLY_KINDS:  # refused for its kind, whatever its fields
        assert message.startswith(f"opaque.parameters.kind: {parameters['kind']} has no counterpart"), message
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "refused"},
        "spec": {"spec": claim["spec"]},
    }
    assert policy_denial(bench.api, namespace, template) == message
    claims = sync_request(bench.api, "GET", f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims")["items"]
    assert claims == []  # nothing was written, so nothing can be allocated
    # in a DeviceClass every claim of the class would be stuck: refused when the class is written
    cls = f"refused-{SUFFIX}"
    assert policy_denial(bench.api, namespace, _device_class(cls, parameters)) == message
    classes = sync_request(bench.api, "GET", f"{RESOURCE_API}/deviceclasses")["items"]
    assert cls not in [c["metadata"]["name"] for c in classes]


def test_a_device_classs_config_is_checked_when_written_and_given_to_its_claims(case: Case) -> None:
    """A class carrying a config the plugin takes is written, and its claims get it; the
    same class with an interval the node refuses is refused (item 2 of issue 49)."""
    name = f"cfg-mps-{SUFFIX}"
    selector = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"'
    mps = {**NV, "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 30}}}
    stuck = {**NV, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}
    assert policy_denial(case.api, case.ns, _device_class(name, stuck, selector)) == _plugin_message(stuck)
    assert policy_denial(case.api, case.ns, _device_class(name, mps, selector)) is None
    try:
        claim = case.create({"requests": [{"name": "gpu", "exactly": {"deviceClassName": name}}]})
        env = case.env_by_request(case.claim_of(claim))
        assert _mps(env["gpu"])["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        case.clear()
        # an edit of the class's config is checked too
        current = sync_request(case.api, "GET", f"{RESOURCE_API}/deviceclasses/{name}")
        current["spec"]["config"][0]["opaque"]["parameters"] = stuck
        with pytest.raises(ApiException) as refused:
            sync_request(case.api, "PUT", f"{RESOURCE_API}/deviceclasses/{name}", current)
        assert api_error(refused.value).endswith(f"denied request: {_plugin_message(stuck)}")
    finally:
        sync_request(case.api, "DELETE", f"{RESOURCE_API}/deviceclasses/{name}")


VFIO_CLASS = f"vfio.{DRIVER}"
VFIO_MESSAGE = (
    f"devices.requests: request gpu asks for class {VFIO_CLASS}, which does not exist: this driver "
    "offers no VFIO passthrough (NVIDIA's class vfio.gpu.nvidia.com has no counterpart here); ask for "
    f"a whole GPU (class {DRIVER}) or a MIG device (class mig.{DRIVER})"
)


def test_a_request_for_nvidias_vfio_class_under_our_domain_is_refused_when_written(
    bench: Bench, namespace: str
) -> None:
    """No such class exists here: admitted, the claim's pod would wait for ever."""
    plain = {"requests": [{"name": "gpu", "exactly": {"deviceClassName": VFIO_CLASS}}]}
    assert policy_denial(bench.api, namespace, claim_body("vfio", plain)) == VFIO_MESSAGE
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "vfio"},
        "spec": {"spec": {"devices": plain}},
    }
    assert policy_denial(bench.api, namespace, template) == VFIO_MESSAGE
    alternatives = {
        "requests": [
            {
                "name": "gpu",
                "firstAvailable": [
                    {"name": "passthrough", "deviceClassName": VFIO_CLASS},
                    {"name": "whole", "deviceClassName": GPU_CLASS},
                ],
            }
        ]
    }
    assert policy_denial(bench.api, namespace, claim_body("vfio", alternatives)) == VFIO_MESSAGE
    # NVIDIA's own class belongs to NVIDIA's driver, which may run beside this one
    theirs = {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "vfio.gpu.nvidia.com"}}]}
    assert policy_denial(bench.api, namespace, claim_body("theirs", theirs), dry_run=True) is None


# the recipe's `sed -e '...' -e '...'` in docs/migrating.md
_SED_EXPRESSION = re.compile(r"-e '([^']+)'")


@pytest.mark.parametrize("spec", ["gpu-test-vfiopci.yaml", "gpu-test-vfio-config.yaml"])
def test_nvidias_vfio_examples_after_the_documented_sed_are_refused_when_written(
    bench: Bench, namespace: str, spec: str
) -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "migrating.md").read_text()
    recipe = docs.split("## The recipe", 1)[1].split("```", 2)[1]
    expressions = [a for e in _SED_EXPRESSION.findall(recipe) for a in ("-e", e)]
    assert expressions, "docs/migrating.md's recipe has no sed expression"
    source = nvidia_source() / "demo" / "specs" / "quickstart" / "v1" / spec
    changed = subprocess.run(["sed", *expressions, str(source)], capture_output=True, text=True,
                             check=True).stdout
    (template,) = [d for d in yaml.safe_load_all(changed) if d and d["kind"] == "ResourceClaimTemplate"]
    del template["metadata"]["namespace"]
    assert policy_denial(bench.api, namespace, template) == VFIO_MESSAGE


def test_another_drivers_config_is_not_ours_to_check(bench: Bench, namespace: str) -> None:
    devices = _one_request({**NV, "kind": "VfioDeviceConfig"})
    devices["config"][0]["opaque"]["driver"] = "gpu.nvidia.com"
    assert policy_denial(bench.api, namespace, claim_body("theirs", devices), dry_run=True) is None


def _nvidia_driver_message(request: str) -> str:
    return (
        "devices.config: an entry with opaque.driver gpu.nvidia.com (NVIDIA's driver) applies to "
        f"request {request}, which asks for this driver's devices only: NVIDIA's driver never "
        "prepares them and this driver reads only entries of its own, so the claim would run "
        f"without this sharing config; change opaque.driver to {DRIVER} (the sed in "
        "docs/migrating.md does it)"
    )


def test_an_nvidia_driver_config_on_this_drivers_classes_is_refused_when_written(
    bench: Bench, namespace: str
) -> None:
    """A claim half-migrated (the class renamed, `opaque.driver` still gpu.nvidia.com) would
    run without its sharing: neither driver reads that entry for this driver's devices."""
    mps = {**NV, "sharing": {"strategy": "MPS"}}

    def devices(classes: dict[str, str], requests: list[str] | None) -> JSON:
        entry: JSON = {"opaque": {"driver": "gpu.nvidia.com", "parameters": mps}}
        if requests is not None:
            entry["requests"] = requests
        return {
            "requests": [{"name": n, "exactly": {"deviceClassName": c}} for n, c in classes.items()],
            "config": [entry],
        }

    def verdict(classes: dict[str, str], requests: list[str] | None) -> str | None:
        half = claim_body("half", devices(classes, requests))
        return policy_denial(bench.api, namespace, half, dry_run=True)

    ours = (DRIVER, f"mig.{DRIVER}", f"gpu-share.{DRIVER}", f"mig-dynamic.{DRIVER}", f"gpu-linked.{DRIVER}")
    for cls in ours:
        for requests in (["gpu"], None):
            assert verdict({"gpu": cls}, requests) == _nvidia_driver_message("gpu"), cls
    mixed = {"theirs": "gpu.nvidia.com", "ours": DRIVER}
    assert verdict(mixed, ["theirs", "ours"]) == _nvidia_driver_message("ours")
    # NVIDIA's own requests, and an entry for every request of a claim that has some of them
    assert verdict(mixed, ["theirs"]) is None
    assert verdict(mixed, None) is None
    assert verdict({"gpu": GPU_CLASS}, None) is None


# --------------------------------------------------------------------------- written before the policy


def test_a_claim_written_before_the_policy_is_allocated_and_refused_by_the_plugin_alone(
    case: Case, bench: Bench
) -> None:
    """The scheduler's finalizer and status updates of a claim the policy would refuse, and
    the finalizer's removal when it is deleted, are not the user's edits: they go through,
    and the plugin refuses the claim on the node with the message the policy gives for the
    same config."""
    parameters = {**NV, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}}
    for doc in reversed(bench.policy):
        sync_request(case.api, "DELETE", _admission_path(doc, name=True))
    wait_for(
        "the claim-config policy to be gone",
        lambda: policy_denial(case.api, case.ns, claim_body("probe", _one_request(parameters)),
                              dry_run=True) is None,
    )
    old_class = f"cfg-old-{SUFFIX}"
    try:
        name = case.create(_one_request(parameters))
        sync_request(case.api, "POST", f"{RESOURCE_API}/deviceclasses", _device_class(old_class, parameters))
    finally:
        for doc in bench.policy:
            sync_request(case.api, "POST", _admission_path(doc), doc)
    _policy_in_effect(case.api, case.ns)
    claim = case.claim_of(name)  # bound: the finalizer and the allocation were written
    assert claim["metadata"].get("finalizers") and allocation_results(claim)
    answer = case.prepare_claim(claim)
    again = claim_body("again", _one_request(parameters))
    policy_message = policy_denial(case.api, case.ns, again, dry_run=True)
    assert policy_message is not None and answer.error.endswith(policy_message), answer.error
    # Deleting it removes the finalizer (an update that changes no spec): it must go through.
    case.clear()
    # A class written before the policy: an edit that changes no spec goes through.
    labelled = sync_request(case.api, "GET", f"{RESOURCE_API}/deviceclasses/{old_class}")
    labelled["metadata"]["labels"] = {"edited": "yes"}
    sync_request(case.api, "PUT", f"{RESOURCE_API}/deviceclasses/{old_class}", labelled)
    sync_request(case.api, "DELETE", f"{RESOURCE_API}/deviceclasses/{old_class}")
