"""NVIDIA's v0.5.0 demo specs (demo/specs of sigs.k8s.io/dra-driver-nvidia-gpu) made ready for
this driver's node tier, and the simulated boxes some of them need.

- `migrated_documents`: a spec after docs/migrating.md's recipe, the `sed` line read from the
  document and run by the real `sed`, so the test runs exactly what a user would apply.
- `runnable`: what the nodes can run of it, nothing else changed: every container becomes
  busybox:1.37 sleeping under `sh -c` (NVIDIA's images and `nvidia-smi` are not on the nodes,
  which have no network), pods get a 1 s grace period, namespaces get a suffix of the test's.
- `create_as_kubectl`: creates one object as `kubectl apply` would (discovery first: an API the
  server does not serve is refused with kubectl's own words; strict field validation).
- `half_balanced_profile` / `mig_1g_12gb_profile`: simulated hardware profiles (YAML files
  `dra-driver kubelet-plugin --simulate PATH` reads) with the MIG devices the MIG specs need.

The specs come from Go's module cache (`nvidia_source`): nothing of NVIDIA's is ever copied
into this repository. Plumbing only: no assertions on what the driver does.
"""

from __future__ import annotations

import copy
import re
import subprocess
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from dra_driver.gpu.sim.profiles import load_profile, resolve_profile_path
from dra_driver.jsontypes import JSON
from tests.harness.cluster import REPO_ROOT
from tests.harness.nvidia_reference import nvidia_source
from tests.harness.objects import api_error, sync_request

BUSYBOX = "docker.io/library/busybox:1.37"
SLEEP = ["sh", "-c", "trap 'exit 0' TERM; sleep 9999 & wait"]
MIGRATING = REPO_ROOT / "docs" / "migrating.md"
# The recipe's expressions: `sed -e '<expression>' \` and `    -e '<expression>' \` lines.
_SED_EXPRESSION = re.compile(r"-e '(?P<expression>[^']+)'")
_POD_TEMPLATE_KINDS = ("Deployment", "ReplicaSet", "StatefulSet", "DaemonSet", "Job")


def specs_dir() -> Path:
    return nvidia_source() / "demo" / "specs"


def spec_files() -> list[str]:
    """Every YAML file under demo/specs, as a path relative to it."""
    root = specs_dir()
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.yaml"))


def recipe() -> tuple[str, ...]:
    """The sed expressions of docs/migrating.md's recipe (its first ```sh block)."""
    text = MIGRATING.read_text()
    section = text.split("## The recipe", 1)[1]
    block = section.split("```sh", 1)[1].split("```", 1)[0]
    expressions = tuple(m.group("expression") for m in _SED_EXPRESSION.finditer(block))
    if not expressions:
        raise ValueError(f"{MIGRATING}: no sed expression in the recipe")
    return expressions


def migrated_text(spec: str) -> str:
    """The spec's text after the recipe, by the real sed."""
    args = [a for e in recipe() for a in ("-e", e)]
    out = subprocess.run(["sed", *args, str(specs_dir() / spec)], capture_output=True, text=True, check=True)
    return out.stdout


def migrated_documents(spec: str) -> list[JSON]:
    return [d for d in yaml.safe_load_all(migrated_text(spec)) if d]


def pod_spec_of(doc: JSON) -> JSON | None:
    """The pod spec in a Pod or in the pod template of a workload; None for other kinds."""
    if doc.get("kind") == "Pod":
        spec: JSON = doc.setdefault("spec", {})
        return spec
    if doc.get("kind") in _POD_TEMPLATE_KINDS:
        template: JSON = doc.setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {})
        return template
    return None


def runnable(docs: Sequence[JSON], suffix: str) -> list[JSON]:
    """The documents as the nodes can run them (busybox, `sh -c` sleep, grace 1 s), every
    namespace renamed `<name>-<suffix>` (a Namespace, and the objects in it)."""
    out = copy.deepcopy(list(docs))
    for doc in out:
        meta = doc.setdefault("metadata", {})
        if doc.get("kind") == "Namespace":
            meta["name"] = f"{meta['name']}-{suffix}"
        elif "namespace" in meta:
            meta["namespace"] = f"{meta['namespace']}-{suffix}"
        spec = pod_spec_of(doc)
        if spec is None:
            continue
        spec["terminationGracePeriodSeconds"] = 1
        for container in spec.get("containers", []):
            container["image"] = BUSYBOX
            container["command"] = list(SLEEP)
            container.pop("args", None)
    return out


def namespaces_of(docs: Iterable[JSON]) -> list[str]:
    """The namespaces the documents create or put objects in, in order of appearance."""
    seen: list[str] = []
    for doc in docs:
        meta = doc.get("metadata", {})
        name = meta["name"] if doc.get("kind") == "Namespace" else meta.get("namespace")
        if name and name not in seen:
            seen.append(name)
    return seen


def expected_pods(docs: Iterable[JSON]) -> int:
    """How many pods the documents make once running (Pods, Deployment replicas, Job parallelism)."""
    count = 0
    for doc in docs:
        kind, spec = doc.get("kind"), doc.get("spec", {})
        if kind == "Pod":
            count += 1
        elif kind in ("Deployment", "ReplicaSet", "StatefulSet"):
            count += int(spec.get("replicas", 1))
        elif kind == "Job":
            count += int(spec.get("parallelism", 1))
    return count


# -- creating objects as kubectl does ---------------------------------------------------------


@dataclass(frozen=True)
class Created:
    """What creating one document did: the server's object, or the refusal's message."""

    kind: str
    name: str
    namespace: str | None
    obj: JSON | None
    refusal: str | None

    @property
    def what(self) -> str:
        return f"{self.kind}/{self.name}"


def _resource(api: client.ApiClient, api_version: str, kind: str) -> JSON | None:
    """The discovery entry of `kind` in `api_version`; None when the server does not serve it."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    try:
        listing = sync_request(api, "GET", base)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    return next(
        (r for r in listing.get("resources", []) if r.get("kind") == kind and "/" not in r["name"]), None
    )


def served(api: client.ApiClient, doc: JSON) -> bool:
    """Whether the server serves the document's kind in its apiVersion (kubectl's discovery)."""
    return _resource(api, str(doc.get("apiVersion")), str(doc.get("kind"))) is not None


def create_as_kubectl(api: client.ApiClient, doc: JSON) -> Created:
    """Create one object as `kubectl apply` would: the kind is looked up in the server's
    discovery first (kubectl's message when it is not served), then POSTed with strict field
    validation (kubectl's default). A refusal is returned, not raised."""
    kind, meta = str(doc.get("kind")), doc.get("metadata", {})
    name, namespace = str(meta.get("name")), meta.get("namespace")
    resource = _resource(api, str(doc.get("apiVersion")), kind)
    if resource is None:
        message = (f'no matches for kind "{kind}" in version "{doc.get("apiVersion")}"; '
                   "ensure CRDs are installed first")
        return Created(kind, name, namespace, None, message)
    api_version = str(doc["apiVersion"])
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace or 'default'}/{resource['name']}" if resource["namespaced"] \
        else f"{base}/{resource['name']}"
    try:
        obj = sync_request(api, "POST", path, doc, query={"fieldValidation": "Strict"})
    except ApiException as e:
        return Created(kind, name, namespace, None, api_error(e))
    return Created(kind, name, namespace, obj, None)


# -- simulated boxes --------------------------------------------------------------------------


def _mig_uuid(*parts: str) -> str:
    return "MIG-" + str(uuid.uuid5(uuid.NAMESPACE_OID, "/".join(parts)))


def _layout(catalog: dict[str, JSON], wanted: dict[str, int]) -> list[tuple[str, int]]:
    """(profile, placement) for `wanted` instances on one empty GPU, as nvidia-mig-parted finds
    them: biggest first, each at a start its profile allows, backtracking when the rest no
    longer fits (3g at 0 leaves no room for 2g + 1g + 1g on an A100; 3g at 4 does)."""
    items = sorted((p for p, n in wanted.items() for _ in range(n)), key=lambda p: -catalog[p]["slices"])

    def place(i: int, used: frozenset[int]) -> list[tuple[str, int]] | None:
        if i == len(items):
            return []
        p = catalog[items[i]]
        for start in p["placements"]:
            span = frozenset(range(start, start + p["placement_size"]))
            if not span & used:
                rest = place(i + 1, used | span)
                if rest is not None:
                    return [(items[i], start), *rest]
        return None

    found = place(0, frozenset())
    if found is None:
        raise ValueError(f"{wanted} does not fit on one GPU")
    return found


def _with_mig(gpu: JSON, catalog: dict[str, JSON], wanted: dict[str, int]) -> JSON:
    devices = [
        {"profile": p, "placement": start, "gpu_instance_id": n + 1,
         "uuid": _mig_uuid(gpu["uuid"], p, str(start))}
        for n, (p, start) in enumerate(_layout(catalog, wanted))
    ]
    return {**gpu, "mig": {"enabled": True, "max_devices": 7, "devices": devices}}


def _write(profile: JSON, path: Path) -> Path:
    path.write_text(yaml.safe_dump(profile, sort_keys=False))
    load_profile(str(path))  # the simulator's own checks: a bad profile fails here, not in the plugin
    return path


def half_balanced_profile(mig_parted_config: Path, path: Path) -> Path:
    """NVIDIA's quickstart box: a DGX A100 (8x A100-SXM4-40GB, the shipped a100-mig profile's
    GPUs and MIG catalog) after `nvidia-mig-parted apply -f mig-parted-config.yaml -c
    half-balanced`, read from that file: GPUs 0-3 in MIG mode with its instances, 4-7 whole."""
    base: JSON = yaml.safe_load(resolve_profile_path("a100-mig").read_text())
    catalog = {p["name"]: p for p in base["mig_profiles"]}
    config: list[JSON] = yaml.safe_load(mig_parted_config.read_text())["mig-configs"]["half-balanced"]
    gpus: list[JSON] = []
    for index, gpu in enumerate(base["gpus"]):
        gpu = {k: v for k, v in gpu.items() if k != "mig"}
        entry = next(e for e in config if e["devices"] == "all" or index in e["devices"])
        gpus.append(_with_mig(gpu, catalog, entry["mig-devices"]) if entry["mig-enabled"] else gpu)
    profile = {**base, "gpus": gpus,
               "description": "DGX A100 40GB after nvidia-mig-parted -c half-balanced (NVIDIA's quickstart)"}
    return _write(profile, path)


# H100 NVL (94 GB) MIG catalog, the 1g profile only: NVIDIA's MIG user guide names it 1g.12gb
# (1 of 7 compute slices, 1 of 8 memory slices). Its memory and SMs here are approximate (about
# an eighth of the memory, Hopper's 16 SMs per slice): the spec selects on the name only.
_H100_NVL_1G = {"name": "1g.12gb", "id": 19, "slices": 1, "memory_mib": 11008, "multiprocessors": 16,
                "copy_engines": 1, "decoders": 1, "jpeg_engines": 1,
                "placements": [0, 1, 2, 3, 4, 5, 6], "placement_size": 1}


def mig_1g_12gb_profile(path: Path) -> Path:
    """Four H100 NVL (94 GB) PCIe cards bridged in pairs (the shipped a100-pcie-bridged box with
    Hopper cards), GPU 0 in MIG mode as seven 1g.12gb, GPUs 1-3 whole: the MIG profile of
    NVIDIA's extended-resources/mig-1g-12gb.yaml exists on no shipped profile."""
    base: JSON = yaml.safe_load(resolve_profile_path("a100-pcie-bridged").read_text())
    defaults = {**base["gpu_defaults"], "name": "NVIDIA H100 NVL", "architecture": "HOPPER",
                "cuda_compute_capability": "9.0", "memory_bytes": 95830 * 2**20}
    catalog = {"1g.12gb": _H100_NVL_1G}
    gpus = [_with_mig(base["gpus"][0], catalog, {"1g.12gb": 7}), *base["gpus"][1:]]
    profile: dict[str, Any] = {**base, "description": "synthetic: 4x H100 NVL, GPU 0 as seven 1g.12gb",
                               "mig_profiles": [_H100_NVL_1G], "gpu_defaults": defaults, "gpus": gpus}
    return _write(profile, path)
