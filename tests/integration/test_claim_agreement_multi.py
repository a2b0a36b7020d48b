"""Whole claims, checked twice: admitted by the chart's policies iff the node would prepare them.

Hypothesis generates whole claims on the classes the chart ships (rendered with
memoryShares and dynamicMig on): 1-4 requests (`exactly`, or `firstAvailable` with 1-3
subrequests), each naming the whole-GPU class, `mig.`, `mig-dynamic.` or `gpu-share.` (with
or without `capacity.requests.memory`), with counts; 0-4 config entries naming every
request, some of them, a subrequest (`req/sub`) or a request the claim lacks, for this
driver, NVIDIA's (`gpu.nvidia.com`) or another one, with parameters of both API versions
(valid ones three times in four, so that the whole-claim rules are reached; else the
single-config strategies of test_claim_config_agreement.py); and configs carried by the
classes themselves (a class of the chart with `spec.config`, as an operator may add).

The policy's answer: writes of the chart's classes with the configs the claim's classes carry
(real writes: the class-config policy reads the classes themselves), then a server-side dry-run
create (nothing stored) of the claim, against claim-config-policy.yaml (both its policies),
memory-shares.yaml and consumable-shares-policy.yaml as the chart's default values render them.

The node's answer, without I/O: every allocation the scheduler may make (each combination
of `firstAvailable` choices), each request given the next free devices of its class on a
simulated node (the eight whole GPUs of `hgx-h200` and their share views, with
consumedCapacity = the request's memory rounded as the scheduler rounds it, and the MIG
devices of `hgx-h200-mig`: its static 3g.71gb, then 1g.18gb placements), its
`status.allocation` built as kube-scheduler 1.37 builds it (results, then class configs with
`source: FromClass` once per class, then the claim's own with `FromClaim`, `requests`
emptied where an entry covers every request), and the plugin's own `ClaimSteps.plan` on it
(the claim checks, the config resolution and `Sharing.plan`: what Prepare runs before it
touches the node). The node refuses a claim if any allocation is refused: a claim admitted
that way is stuck whenever the scheduler takes that alternative.

Compared: admitted by the policies iff the node prepares every allocation; where both refuse,
the policy's rule (its field path, or a key phrase) must be one the node names for the claim
(any allocation, or one of its entries parsed alone). An API-server validation error counts
as a refusal without a rule.

Rules of the policies that the node does not have, on purpose (the claim would run, but not
as asked): `capacity.requests.memory` on the whole-GPU class without consumable shares, a
share's memory that is not whole Gi, an entry for NVIDIA's driver on this driver's requests.
The model knows them; such a claim must be refused.

Known node-only, not generated: per-device limit keys that are device UUIDs (which device a
UUID names depends on the allocation); `allocationMode: All`; counts that the simulated node
cannot hold. `adminAccess` is generated on about one `exactly` request in 25 (the bench's
namespace carries the label the API server wants for it); on the MIG class it is a rule of the
policies' own (the scheduler may give such a request a dynamic slice, this model never does).

A class whose config the policies refuse when it is written is judged on the class alone: the
node must refuse a claim of one device of the class (its smallest share for the share class)
with no config of its own.

No disagreement is known: a class's own config together with the claim's (two thread
percentages, a per-device index counted over both, a share limit from the class) is the
class-config policy's, which the API server evaluates once per class of the chart with the
class as its params; so the classes are written for real (labelled as the chart labels them,
their configs set per claim, and waited on until the policies see them), and the claims whose
classes carry configs are checked one at a time, the others concurrently while no class has
one. The eight kinds of disagreement issue 49 item 6 held as strict xfails are
test_a_formerly_known_disagreement_agrees.

Two runs: a fixed seed, and a random one that is printed (and named in any failure), each
of at least 5,000 claims, sent in batches on several connections at once.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from dra_driver.devices import NodeDevice, node_devices
from dra_driver.driver_root import DriverFiles
from dra_driver.gpu import discover
from dra_driver.gpu.mig import MigInstances
from dra_driver.plugin.claim_steps import ClaimSteps
from dra_driver.plugin.claims import ClaimRef, ClaimRejected, ForeignAllocation
from dra_driver.plugin.mig_steps import dynamic_devices
from dra_driver.sharing.config import ConfigError
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.nvidia_config import parse_claim_config
from dra_driver.sharing.policy import Sharing
from dra_driver.sharing.shares import GI, memory_policy, share_views
from tests.harness.admission import ClassesInForce, PolicyBench, policy_bench
from tests.harness.cluster import ControlPlane
from tests.harness.driver_image import render_chart
from tests.harness.objects import RESOURCE_API, api_error, sync_request
from tests.integration.test_claim_config_agreement import parameters as any_parameters

DRIVER = "multi.dra-driver.dev"  # a release of its own: its policies are named after it
WHOLE, MIG, MIG_DYN, SHARE = DRIVER, f"mig.{DRIVER}", f"mig-dynamic.{DRIVER}", f"gpu-share.{DRIVER}"
NVIDIA_DRIVER = "gpu.nvidia.com"
NV = "resource.nvidia.com/v1beta1"
OURS = f"{DRIVER}/v1alpha1"
DENIED = "denied request: "
# The labels of the chart's DeviceClasses as `helm template r` renders them: the class-config
# policy's binding selects the classes so labelled.
CLASS_LABELS = {"app.kubernetes.io/name": "gpu-dra-driver", "app.kubernetes.io/instance": "r"}
SYNC_CLASS = "sync-probe.example.com"  # labelled alike; not named after the driver: no class rule of its own
POOL = "multi-node"
FIXED_SEED = 49
PER_RUN = int(os.environ.get("MULTI_CLAIMS", "5000"))  # fewer while developing
BATCH = 5  # claims per Hypothesis example, sent concurrently
THREADS = 8
_PATH = re.compile(r"[^ :]+")
_ENTRY = re.compile(r"^config\[\d+\] \(from [^)]*\) ")


# --------------------------------------------------------------------------- what is generated

_limits = st.sampled_from(["1Gi", "4Gi", "8Gi", "10Gi", "20Gi", "64Gi", 4 * GI])
_percentages = st.sampled_from([25, 50, 50, 100])
_our_mps = st.fixed_dictionaries(
    {}, optional={"defaultActiveThreadPercentage": _percentages, "defaultPinnedDeviceMemoryLimit": _limits,
                  "shmSize": st.just("1Gi")}
)
_nv_mps = st.fixed_dictionaries(
    {},
    optional={
        "defaultActiveThreadPercentage": _percentages,
        "defaultPinnedDeviceMemoryLimit": _limits,
        # index keys only: a UUID key is node-only (which device it names depends on the allocation)
        "defaultPerDevicePinnedMemoryLimit": st.dictionaries(st.sampled_from(["0", "1", "2"]), _limits,
                                                             min_size=1, max_size=2),
        "multiUser": st.just(False),
    },
)
_ours_valid = st.fixed_dictionaries(
    {"apiVersion": st.sampled_from([OURS, OURS, "gpu.dra-driver.dev/v1alpha1"]),
     "kind": st.just("GpuConfig")},
    optional={"sharing": st.one_of(
        st.just({"strategy": "TimeSlicing"}),
        st.builds(lambda m: {"strategy": "MPS", "mps": m}, _our_mps),
        st.builds(lambda m: {"strategy": "MPS", "mps": m}, _our_mps),
    )},
)


@st.composite
def _nv_valid(draw: Any, fits: str | None = None) -> dict[str, Any]:
    """`fits`: the kind that fits the devices of the requests the entry applies to, taken
    four times in five (else either kind)."""
    kinds = ["GpuConfig", "MigDeviceConfig"]
    kind = draw(st.sampled_from(kinds if fits is None else [fits] * 8 + kinds))
    params: dict[str, Any] = {"apiVersion": NV, "kind": kind}
    strategy = draw(st.sampled_from([None, "TimeSlicing", "MPS", "MPS"]))
    if strategy == "MPS":
        params["sharing"] = {"strategy": "MPS", "mpsConfig": draw(_nv_mps)}
    elif strategy == "TimeSlicing":
        params["sharing"] = {"strategy": "TimeSlicing"}
        if kind == "GpuConfig" and draw(st.booleans()):
            params["sharing"]["timeSlicingConfig"] = {"interval": "Default"}
    return params


def valid_parameters(fits: str | None = None) -> Any:
    return st.one_of(_ours_valid, _nv_valid(fits), _nv_valid(fits))


def claim_parameters(fits: str | None = None) -> Any:
    """Valid parameters three times in four, else anything the single-config test sends."""
    valid = valid_parameters(fits)
    return st.one_of(valid, valid, valid, any_parameters)


def mps_percentage(kind: str | None) -> Any:
    """An MPS config with only a thread percentage (of two), ours or NVIDIA's of `kind`: a class's
    config of this kind meets the claim's and the other classes' percentages often."""
    pct = st.sampled_from([25, 50])
    nvidia = pct.map(lambda p: {
        "apiVersion": NV, "kind": kind or "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": p}}})
    ours = pct.map(lambda p: {"apiVersion": OURS, "kind": "GpuConfig",
                              "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": p}}})
    return nvidia if kind == "MigDeviceConfig" else st.one_of(nvidia, ours)


def _fitting_kind(classes: set[str]) -> str | None:
    if classes and classes <= {WHOLE, SHARE}:
        return "GpuConfig"
    if classes and classes <= {MIG, MIG_DYN}:
        return "MigDeviceConfig"
    return None
OTHER_PARAMETERS = {"apiVersion": "example.com/v1", "kind": "Other"}
_CLASSES = [WHOLE, WHOLE, WHOLE, MIG, MIG, MIG_DYN, MIG_DYN, SHARE, SHARE, SHARE]
SHARE_MEMORY = ("1Gi", "4Gi", "8Gi", "10Gi", "20Gi", "40Gi", "140Gi")
NOT_WHOLE_GI = ("40G", "512Mi", "10.5Gi")  # a rule of the policies' own


def _rarely(n: int) -> Any:
    """True about once in `n` (Hypothesis draws the ends of a range more often than the rest:
    a value from the middle keeps it rare)."""
    return st.integers(0, n - 1).map(lambda i: i == n // 2)


@st.composite
def device_request(draw: Any) -> dict[str, Any]:
    cls = draw(st.sampled_from(_CLASSES))
    out: dict[str, Any] = {"deviceClassName": cls}
    count = draw(st.sampled_from([None, 1, 1, 2]))
    if count is not None:
        out["count"] = count
    if cls == SHARE and not draw(_rarely(5)):
        memory = NOT_WHOLE_GI if draw(_rarely(20)) else SHARE_MEMORY
        out["capacity"] = {"requests": {"memory": draw(st.sampled_from(memory))}}
    elif cls == WHOLE and draw(_rarely(100)):  # not shared here: a rule of the policy's own
        out["capacity"] = {"requests": {"memory": "40Gi"}}
    return out


@st.composite
def _entry(draw: Any, names: list[str], subs: list[str], classes: dict[str, set[str]]) -> dict[str, Any]:
    """A claim's config entry; `classes`: the classes each request and subrequest may get."""
    shape = draw(st.integers(0, 99))
    requests: list[str]
    if shape < 40:
        requests = []
    elif shape < 72:
        requests = [draw(st.sampled_from(names))]
    elif shape < 85:
        requests = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    else:
        requests = [draw(st.sampled_from(subs or names))]
    if draw(_rarely(40)):
        requests = ["zz"]  # no such request: the API server's own validation refuses it
    driver = draw(st.sampled_from([DRIVER] * 38 + [NVIDIA_DRIVER, "other.example.com"]))
    fits = _fitting_kind({c for n in requests or names for c in classes.get(n, set())})
    params = draw(claim_parameters(fits)) if driver != "other.example.com" else OTHER_PARAMETERS
    entry: dict[str, Any] = {"opaque": {"driver": driver, "parameters": params}}
    if requests:
        entry["requests"] = requests
    return entry


@dataclass(frozen=True)
class Case:
    """A claim's spec.devices and the configs its classes carry (class -> spec.config)."""

    devices: dict[str, Any]
    classes: dict[str, list[dict[str, Any]]]

    def to_json(self) -> str:
        return json.dumps({"devices": self.devices, "classConfigs": self.classes})


@st.composite
def cases(draw: Any) -> Case:
    requests: list[dict[str, Any]] = []
    for name in "abcd"[: draw(st.integers(1, 4))]:
        if draw(st.integers(0, 3)) < 3:
            exactly = draw(device_request())
            if draw(_rarely(25)):  # a monitor's request (the bench's namespace allows it)
                exactly["adminAccess"] = True
            requests.append({"name": name, "exactly": exactly})
        else:
            subs = [{"name": s, **draw(device_request())} for s in "xyz"[: draw(st.integers(1, 3))]]
            requests.append({"name": name, "firstAvailable": subs})
    names = [r["name"] for r in requests]
    subs = [f"{r['name']}/{s['name']}" for r in requests for s in r.get("firstAvailable", [])]
    devices: dict[str, Any] = {"requests": requests}
    of = {r["name"]: set(_classes_of(r)) for r in requests}
    for r in requests:
        of |= {f"{r['name']}/{s['name']}": {s["deviceClassName"]} for s in r.get("firstAvailable", [])}
    config = draw(st.lists(_entry(names, subs, of), max_size=4))
    if config:
        devices["config"] = config
    used = sorted({c for r in requests for c in _classes_of(r)})
    classes: dict[str, list[dict[str, Any]]] = {}
    for cls in used:
        if draw(_rarely(5)):
            classes[cls] = [
                {"opaque": {"driver": draw(st.sampled_from([DRIVER] * 9 + ["other.example.com"])),
                            "parameters": draw(st.one_of(claim_parameters(_fitting_kind({cls})),
                                                         mps_percentage(_fitting_kind({cls}))))}}
                for _ in range(draw(st.integers(1, 2)))
            ]
            for entry in classes[cls]:
                if entry["opaque"]["driver"] != DRIVER:
                    entry["opaque"]["parameters"] = OTHER_PARAMETERS
    return Case(devices, classes)


def _classes_of(request: Mapping[str, Any]) -> list[str]:
    if "exactly" in request:
        return [request["exactly"]["deviceClassName"]]
    return [s["deviceClassName"] for s in request["firstAvailable"]]


# --------------------------------------------------------------------------- the node's answer


@dataclass(frozen=True)
class Node:
    """The simulated node: ClaimSteps over its devices, and each class's devices in the order
    this model's scheduler hands them out."""

    steps: ClaimSteps
    whole: tuple[str, ...]  # whole GPUs, each also a share view `<name>-share`
    static_mig: tuple[str, ...]
    slices: tuple[str, ...]  # dynamic MIG placements with disjoint memory slices


@cache
def node() -> Node:
    whole_gpus = node_devices(discover("hgx-h200"))
    mig_inventory = discover("hgx-h200-mig")
    static = {n: d for n, d in node_devices(mig_inventory).items() if d.mig is not None}
    placements, carved = dynamic_devices(mig_inventory)
    slices = tuple(n for n in sorted(carved) if "-mig-1g-18gb-19-" in n)
    devices: dict[str, NodeDevice] = {**whole_gpus, **share_views(whole_gpus), **static,
                                      **{n: carved[n] for n in slices}}
    files = DriverFiles("/", (), (), (), (), (), None, None, 0)
    sharing = Sharing(DRIVER, POOL, cast(MpsControl, None))
    steps = ClaimSteps(DRIVER, POOL, devices, files, Path("/nonexistent/cdi"), Path("/nonexistent/state"),
                       sharing, "boot", cast(MigInstances, object()), {n: placements[n] for n in slices})
    return Node(steps, tuple(sorted(whole_gpus)), tuple(sorted(static)), slices)


def _memory(sub: Mapping[str, Any]) -> int:
    """A share request's memory as the scheduler gives it: the request rounded up onto the
    share's validRange, or its default."""
    policy = memory_policy(discover_memory())
    assert policy is not None
    raw = (sub.get("capacity") or {}).get("requests", {}).get("memory")
    if raw is None:
        return policy.default
    from dra_driver.sharing.config import quantity_value

    value = quantity_value(raw)
    assert value is not None
    return policy.rounded(int(value))


@cache
def discover_memory() -> int:
    return node().steps.devices["gpu-0"].gpu.memory_bytes


def allocated(case: Case, choice: tuple[int, ...], uid: str) -> dict[str, Any]:
    """The claim as the API server would hand it to the plugin after the scheduler allocated
    it with `choice` (the subrequest taken of each request; 0 for `exactly`)."""
    n = node()
    gpus, static, slices = list(n.whole), list(n.static_mig), list(n.slices)
    requests = case.devices["requests"]
    results: list[dict[str, Any]] = []
    chosen: list[tuple[str, dict[str, Any]]] = []  # (result request name, exactly/subrequest)
    for request, pick in zip(requests, choice, strict=True):
        if "exactly" in request:
            chosen.append((request["name"], request["exactly"]))
        else:
            sub = request["firstAvailable"][pick]
            chosen.append((f"{request['name']}/{sub['name']}", sub))
    for name, sub in chosen:
        cls = sub["deviceClassName"]
        for _ in range(sub.get("count", 1)):
            result: dict[str, Any] = {"request": name, "driver": DRIVER, "pool": POOL}
            if sub.get("adminAccess"):
                result["adminAccess"] = True
            if cls == WHOLE:
                result["device"] = gpus.pop(0)
            elif cls == SHARE:
                result["device"] = f"{gpus.pop(0)}-share"
                result["shareID"] = f"{len(results):08x}-0000-4000-8000-000000000000"
                result["consumedCapacity"] = {"memory": f"{_memory(sub) // GI}Gi"}
            elif cls == MIG and static:
                result["device"] = static.pop(0)
            else:
                result["device"] = slices.pop(0)
            results.append(result)
    config: list[dict[str, Any]] = []
    ranges: dict[str, tuple[int, int]] = {}
    for name, sub in chosen:  # the class's configs once per class, naming every request of it
        cls = sub["deviceClassName"]
        if cls in ranges:
            for i in range(*ranges[cls]):
                config[i]["requests"].append(name)
            continue
        start = len(config)
        config += [{"source": "FromClass", "requests": [name], **c} for c in case.classes.get(cls, [])]
        ranges[cls] = (start, len(config))
    picked = {name for name, _ in chosen} | {r["name"] for r in requests}
    for entry in case.devices.get("config", []):
        own = entry.get("requests") or []
        if not own or picked & set(own):
            config.append({"source": "FromClaim", **entry})
    for entry in config:  # an entry that covers every request: `requests` emptied
        if entry.get("requests") and all(
            r["name"] in entry["requests"] or name in entry["requests"]
            for r, (name, _) in zip(requests, chosen, strict=True)
        ):
            del entry["requests"]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns", "uid": uid},
        "spec": {"devices": case.devices},
        "status": {"allocation": {"devices": {"results": results, "config": config}}},
    }


def node_key(message: str) -> str:
    """The rule a plugin refusal names: a field path of the config, or a key phrase."""
    text = message.split(f"invalid configuration for driver {DRIVER}: ", 1)[-1]
    text = _ENTRY.sub("", text)
    if text.startswith("opaque.parameters"):
        match = _PATH.match(text)
        return match.group(0) if match else text
    for phrase, key in _NODE_PHRASES:
        if phrase in text:
            return key
    return "other: " + text[:80]


_NODE_PHRASES = (
    ("is a memory share, which is always served by MPS", "share-strategy"),
    ("cannot apply", "kind"),
    ("is more than the share of", "share-limit"),
    ("must have the same mps.defaultActiveThreadPercentage", "thread-percentage"),
    ("defaultPerDevicePinnedMemoryLimit: key", "per-device-key"),
    ("MPS must be configured for all devices of a request", "mps-all-or-none"),
    ("holds two shares of", "two-shares"),
    ("is a dynamic MIG slice, made for one claim", "admin-slice"),
)


def _choices(case: Case) -> Iterator[tuple[int, ...]]:
    return itertools.product(*(range(len(r.get("firstAvailable", [None]))) for r in case.devices["requests"]))


def _plan_keys(case: Case) -> list[str]:
    """What the plugin says of each allocation it refuses ([] : it prepares every one)."""
    keys = []
    for choice in _choices(case):
        uid = "4b9e0a3c-0000-4000-8000-000000000049"
        try:
            node().steps.plan(ClaimRef("ns", "c", uid), allocated(case, choice, uid))
        except ForeignAllocation as e:  # this model's allocation is not what the scheduler writes
            raise AssertionError(f"the model's allocation {choice} is not the claim's own: {e}") from e
        except ClaimRejected as e:
            keys.append(node_key(str(e)))
    return keys


def _parse_key(params: Any) -> str | None:
    try:
        parse_claim_config(json.loads(json.dumps(params)), DRIVER, "opaque.parameters")
    except ConfigError as e:
        return node_key(str(e))
    return None


def _ours(entry: Mapping[str, Any]) -> bool:
    return bool(entry["opaque"]["driver"] == DRIVER)


@dataclass
class NodeVerdict:
    refused: list[str]  # the rule of each allocation refused
    rules: set[str] = field(default_factory=set)  # every rule the node names for the claim

    @property
    def prepares(self) -> bool:
        return not self.refused


def node_verdict(case: Case) -> NodeVerdict:
    refused = _plan_keys(case)
    rules = set(refused)
    entries = [*(e for es in case.classes.values() for e in es), *case.devices.get("config", [])]
    bad = {id(e) for e in entries if _ours(e) and _parse_key(e["opaque"]["parameters"]) is not None}
    rules |= {k for e in entries if _ours(e) and (k := _parse_key(e["opaque"]["parameters"])) is not None}
    for entry in case.devices.get("config", []):  # each entry as if it were the last (none overridden)
        if _ours(entry):
            if id(entry) in bad:  # its kind alone, which the policies check before its fields
                params = entry["opaque"]["parameters"]
                params = params if isinstance(params, dict) else {}
                kind = {k: params[k] for k in ("apiVersion", "kind") if k in params}
                if _parse_key(kind) is not None:
                    continue
                entry = {**entry, "opaque": {**entry["opaque"], "parameters": kind}}
            rules |= set(_plan_keys(Case({**case.devices, "config": [entry]}, case.classes)))
    if bad:  # the rules the node would name once the entries it cannot read are fixed
        fixed = Case(
            {**case.devices, "config": [e for e in case.devices.get("config", []) if id(e) not in bad]},
            {c: [e for e in es if id(e) not in bad] for c, es in case.classes.items()},
        )
        rules |= set(_plan_keys(fixed))
    if "admin-slice" in rules:  # the node stops there first: what it would say without adminAccess
        def plain(r: dict[str, Any]) -> dict[str, Any]:
            return {**r, "exactly": {k: v for k, v in r["exactly"].items() if k != "adminAccess"}}

        requests = [plain(r) if "exactly" in r else r for r in case.devices["requests"]]
        rules |= node_verdict(Case({**case.devices, "requests": requests}, case.classes)).rules
    return NodeVerdict(refused, rules)


def policy_only(case: Case) -> str | None:
    """A rule of the policies that the node does not have (the claim would run, not as asked)."""
    requests = case.devices["requests"]
    names = {r["name"] for r in requests} | {
        f"{r['name']}/{s['name']}" for r in requests for s in r.get("firstAvailable", [])
    }
    for entry in case.devices.get("config", []):
        if not set(entry.get("requests", [])) <= names:
            return "api: a config names a request the claim lacks"
    for request in requests:
        for sub in [request["exactly"]] if "exactly" in request else request["firstAvailable"]:
            memory = (sub.get("capacity") or {}).get("requests", {}).get("memory")
            if memory is None:
                continue
            if sub["deviceClassName"] == WHOLE:
                return "memory-on-whole"
            if memory not in SHARE_MEMORY:
                return "share-memory-gi"
    if any(r["exactly"]["deviceClassName"] == MIG and r["exactly"].get("adminAccess") for r in requests
           if "exactly" in r):
        return "admin-mig"  # the scheduler may give it a dynamic slice; this model gives static ones first
    main = {r["name"] for r in requests}
    for entry in case.devices.get("config", []):
        named = entry.get("requests")
        if entry["opaque"]["driver"] == NVIDIA_DRIVER and (not named or main & set(named)):
            return "nvidia-driver"
    return None


# --------------------------------------------------------------------------- the policies' answer


@dataclass(frozen=True)
class PolicyVerdict:
    admitted: bool
    rule: str | None  # None: admitted, or refused by the API server's own validation
    message: str
    at_class: str | None = None  # the class whose write was refused, if that came first


_POLICY_PHRASES = (
    ("cannot apply to", "kind"),
    ("is more than the share", "share-limit"),
    ("names none of the devices this config applies to", "per-device-key"),
    ("a slice is made for one claim and cannot be given with adminAccess", "admin-slice"),
    ("which cannot be given with adminAccess: add the selector", "admin-mig"),
    ("asks for a memory share, which is always served by MPS", "share-strategy"),
    ("must have the same", "thread-percentage"),
    ("devices.config: an entry with opaque.driver gpu.nvidia.com", "nvidia-driver"),
    ("must be a whole number of Gi", "share-memory-gi"),
    ("capacity.requests.memory on class", "memory-on-whole"),
)


def policy_key(text: str) -> str:
    for phrase, key in _POLICY_PHRASES:
        if phrase in text:
            return key
    match = _PATH.match(text)
    return match.group(0) if match else ""


def _refusal(e: ApiException) -> PolicyVerdict:
    message = api_error(e)
    if DENIED in message:
        text = message.split(DENIED, 1)[1]
        return PolicyVerdict(False, policy_key(text), text)
    if e.status in (400, 422):  # the API server's own validation: refused, no rule of ours
        return PolicyVerdict(False, None, message)
    raise e


def _dry_run(api: client.ApiClient, path: str, body: dict[str, Any]) -> PolicyVerdict | None:
    try:
        sync_request(api, "POST", path, body, query={"dryRun": "All"})
    except ApiException as e:
        return _refusal(e)
    return None


def policy_verdict(
    api: client.ApiClient, namespace: str, case: Case, classes: ClassesInForce | None = None
) -> PolicyVerdict:
    """The classes written with their configs first (as an operator would: `classes`, the
    bench's real classes, which the class-config policy reads), then the claim (a dry run).
    Without `classes` the bench's classes must be as they are, with no config."""
    if classes is not None:
        try:
            classes.set(case.classes)
        except ClassesInForce.Refused as refused:
            verdict = _refusal(refused.error)
            return PolicyVerdict(False, verdict.rule, verdict.message, refused.name)
    elif case.classes:
        raise ValueError("a claim whose classes carry configs needs the bench's classes (ClassesInForce)")
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "multi"},
            "spec": {"devices": case.devices}}
    return _dry_run(api, f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims", body) or PolicyVerdict(
        True, None, ""
    )


# --------------------------------------------------------------------------- the comparison

def class_probe(cls: str, config: list[dict[str, Any]]) -> Case:
    """A claim of one device of `cls` with the class's config as its own (the node reads the
    two alike for a claim of one request): what a class's config is checked against when the
    class is written (the share class: its smallest share, 1Gi)."""
    return _probe(cls, "1Gi" if cls == SHARE else None, config)


def classes_probe(case: Case, last: str) -> Case:
    """A claim of one device of each class of `case` with a config, in name order up to `last`
    (the share class: its smallest share), the classes with their configs."""
    names = [c for c in sorted(case.classes) if c <= last]
    requests = [{"name": f"r{i}", "exactly": {"deviceClassName": c, **(
        {"capacity": {"requests": {"memory": "1Gi"}}} if c == SHARE else {})}} for i, c in enumerate(names)]
    return Case({"requests": requests}, {c: case.classes[c] for c in names})


def disagreement(case: Case, policy: PolicyVerdict, node_answer: NodeVerdict | None) -> str | None:
    """What is wrong with the two answers; None if they agree."""
    if policy.at_class is not None and policy.rule == "thread-percentage":
        # refused beside a class written before it: a claim of one device of each class with a
        # config, up to this one, must be refused by the node for its two thread percentages
        probe = classes_probe(case, policy.at_class)
        answer = node_verdict(probe)
        if answer.prepares or "thread-percentage" not in answer.rules:
            return f"class {policy.at_class}: refused beside other classes the node prepares: {answer}"
        return None
    if policy.at_class is not None:  # refused when the class was written: judged on the class alone
        probe = class_probe(policy.at_class, case.classes[policy.at_class])
        problem = disagreement(probe, replace(policy, at_class=None), node_verdict(probe))
        return None if problem is None else f"class {policy.at_class}: {problem}"
    only = policy_only(case)
    if only is not None:
        return f"admitted, though a rule of the policies' own ({only}) applies" if policy.admitted else None
    assert node_answer is not None
    if policy.admitted and node_answer.prepares:
        return None
    if policy.admitted:
        return f"admitted, refused by the node ({', '.join(sorted(set(node_answer.refused)))})"
    if node_answer.prepares:
        return f"refused by the policies ({policy.rule}), prepared by the node"
    if policy.rule is None or policy.rule in node_answer.rules:
        return None
    if "per-device-key" in node_answer.rules and policy.rule in ("kind", "share-limit", "share-strategy"):
        return None  # the node resolves per-device keys first and stops there
    return f"refused for different rules: policy {policy.rule}, node {sorted(node_answer.rules)}"


# --------------------------------------------------------------------------- the bench


def rendered_policies(tmp: Path) -> list[dict[str, Any]]:
    """The chart's policies for claims and classes, as its default values render them with
    memoryShares and dynamicMig on (the shipped classes themselves are not created: a dry
    run of each class with a config stands for the class)."""
    docs: list[dict[str, Any]] = []
    for template in ("claim-config-policy", "memory-shares", "consumable-shares-policy"):
        docs += render_chart(tmp, f"driverName={DRIVER}", "memoryShares.enabled=true",
                             "dynamicMig.enabled=true", show_only=f"templates/{template}.yaml")
    return [d for d in docs if d["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")]


def _probe(cls: str, memory: str | None, config: list[dict[str, Any]] | None = None) -> Case:
    exactly: dict[str, Any] = {"deviceClassName": cls}
    if memory:
        exactly["capacity"] = {"requests": {"memory": memory}}
    devices: dict[str, Any] = {"requests": [{"name": "a", "exactly": exactly}]}
    if config:
        devices["config"] = config
    return Case(devices, {})




@dataclass
class MultiBench(PolicyBench):
    """The policies' bench with the chart's DeviceClasses in force (their configs set per claim)."""

    classes: ClassesInForce


def _sync_config(pct: int) -> list[dict[str, Any]]:
    return [_cfg(_pct(pct))]


def sync_refused(api: client.ApiClient) -> Any:
    """Whether a claim of the barrier class (with its config's percentage) and of another class
    (with a config of the claim's percentage) is refused: once the policies see the class."""
    def refused(namespace: str, cls: str, class_pct: int, claim_pct: int) -> bool:
        case = Case({"requests": [{"name": "a", "exactly": {"deviceClassName": cls}},
                                  {"name": "b", "exactly": {"deviceClassName": "other.example.com"}}],
                     "config": [_cfg(_pct(claim_pct), "b")]}, {})
        verdict = policy_verdict(api, namespace, case)
        return not verdict.admitted and verdict.rule == "thread-percentage"
    return refused


@pytest.fixture(scope="module")
def bench(
    control_plane: ControlPlane, api: client.ApiClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MultiBench]:
    probes = [  # one claim each policy refuses
        _probe(WHOLE, None, [{"opaque": {"driver": DRIVER, "parameters": {"apiVersion": OURS}}}]),
        _probe(SHARE, "1G"),
        _probe(WHOLE, "1Gi"),
    ]
    def refused(ns: str) -> bool:
        return all(not policy_verdict(api, ns, p).admitted for p in probes)

    policies = rendered_policies(tmp_path_factory.mktemp("helm"))
    node()  # discovered once, before the threads
    admin = {"resource.kubernetes.io/admin-access": "true"}
    with policy_bench(control_plane, api, policies, "multi", refused, THREADS, admin) as plain:
        classes = ClassesInForce(api, plain.namespace, CLASS_LABELS, [WHOLE, MIG, MIG_DYN, SHARE], SYNC_CLASS,
                                 sync_refused(api), _sync_config)
        try:
            classes.set({})
            yield MultiBench(plain.clients, plain.namespace, classes)
        finally:
            classes.delete()


@dataclass
class Tally:
    checked: int = 0
    seen: Counter[str] = field(default_factory=Counter)
    wrong: dict[str, str] = field(default_factory=dict)  # an example of each disagreement


def check_agreement(bench: MultiBench, run_seed: int, per_run: int = PER_RUN) -> tuple[Tally, float]:
    """Runs the property with `run_seed`; returns what was checked and the seconds."""
    tally = Tally()
    pool = ThreadPoolExecutor(THREADS)

    def both(i_case: tuple[int, Case]) -> tuple[Case, PolicyVerdict, NodeVerdict | None]:
        i, case = i_case
        answer = None if policy_only(case) else node_verdict(case)
        classes = bench.classes if case.classes else None  # the others run while no class has a config
        return case, policy_verdict(bench.clients[i % THREADS], bench.namespace, case, classes), answer

    @settings(
        max_examples=per_run // BATCH,
        database=None,
        deadline=None,
        phases=[Phase.generate],  # every disagreement is listed at the end, none shrunk
        suppress_health_check=list(HealthCheck),
    )
    @seed(run_seed)
    @given(st.lists(cases(), min_size=BATCH, max_size=BATCH))
    def agree(batch: list[Case]) -> None:
        bench.classes.set({})
        answers = list(pool.map(both, [(i, c) for i, c in enumerate(batch) if not c.classes]))
        answers += [both((i, c)) for i, c in enumerate(batch) if c.classes]
        for case, policy, answer in answers:
            problem = disagreement(case, policy, answer)
            if problem:
                tally.seen["DISAGREE"] += 1
                tally.wrong.setdefault(
                    problem, f"claim {case.to_json()}\n  policy: {policy}\n  node: {answer}"
                )
            else:
                tally.seen["policy-only rule" if answer is None else
                           "admitted" if policy.admitted else "refused by both"] += 1
        tally.checked += len(answers)

    start = time.monotonic()
    try:
        agree()
    finally:
        pool.shutdown()
    return tally, time.monotonic() - start


@pytest.mark.parametrize("which", ["fixed", "random"])
def test_the_policies_admit_a_whole_claim_iff_the_node_prepares_it(bench: MultiBench, which: str) -> None:
    run_seed = FIXED_SEED if which == "fixed" else random.randrange(2**32)
    print(f"\n[multi] seed {run_seed} ({which})")
    tally, seconds = check_agreement(bench, run_seed)
    print(f"[multi] seed {run_seed}: {tally.checked} claims in {seconds:.1f} s: {dict(tally.seen)}")
    assert not tally.wrong, f"seed {run_seed}: {tally.seen['DISAGREE']} claims disagree, e.g.:\n" + "\n".join(
        f"{problem}\n  {example}" for problem, example in tally.wrong.items()
    )
    assert tally.checked >= PER_RUN, f"seed {run_seed}: only {tally.checked} claims were generated"


# --------------------------------------------------------------------------- the known ones, one each

_NVMPS = {"apiVersion": NV, "kind": "GpuConfig"}


def _share(memory: str | None = None) -> dict[str, Any]:
    return {"deviceClassName": SHARE, **({"capacity": {"requests": {"memory": memory}}} if memory else {})}


def _cfg(params: dict[str, Any], *requests: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"opaque": {"driver": DRIVER, "parameters": params}}
    if requests:
        entry["requests"] = list(requests)
    return entry


_MPS = {"apiVersion": OURS, "kind": "GpuConfig"}
_LIMIT_10GI = {**_MPS, "sharing": {"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "10Gi"}}}


def _pct(p: int) -> dict[str, Any]:
    return {**_MPS, "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": p}}}
FORMERLY_KNOWN = {
    "per-device-key": Case({
        "requests": [{"name": "a", "exactly": {"deviceClassName": MIG_DYN, "count": 2}}],
        "config": [_cfg({**_NVMPS, "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS", "mpsConfig": {
            "defaultPerDevicePinnedMemoryLimit": {"2": "1Gi"}}}}, "a")],
    }, {}),
    "thread-percentage": Case({
        "requests": [{"name": "a", "exactly": {"deviceClassName": WHOLE}},
                     {"name": "b", "exactly": {"deviceClassName": WHOLE}}],
        "config": [_cfg(_pct(25), "a"), _cfg(_pct(50), "b")],
    }, {}),
    "kind (firstAvailable)": Case({
        "requests": [{"name": "a", "firstAvailable": [{"name": "x", "deviceClassName": WHOLE},
                                                      {"name": "y", "deviceClassName": MIG}]}],
        "config": [_cfg({**_NVMPS, "kind": "MigDeviceConfig"}, "a")],
    }, {}),
    "kind (class config)": Case({"requests": [{"name": "a", "exactly": {"deviceClassName": MIG}}]},
                                {MIG: [_cfg(_NVMPS)]}),
    "share-strategy (class config)": Case({"requests": [{"name": "a", "exactly": _share("8Gi")}]},
                                          {SHARE: [_cfg(_MPS | {"sharing": {"strategy": "TimeSlicing"}})]}),
    "share-limit (default 8Gi share)": Case({
        "requests": [{"name": "a", "exactly": _share()}],
        "config": [_cfg(_LIMIT_10GI)],
    }, {}),
    "share-limit (firstAvailable)": Case({
        "requests": [{"name": "a", "firstAvailable": [{"name": "x", **_share("4Gi")}]}],
        "config": [_cfg(_LIMIT_10GI)],
    }, {}),
    "kind-overridden": Case({
        "requests": [{"name": "a", "exactly": {"deviceClassName": WHOLE}},
                     {"name": "b", "exactly": {"deviceClassName": MIG}}],
        "config": [_cfg(_NVMPS), _cfg({**_NVMPS, "kind": "MigDeviceConfig"}, "b")],
    }, {}),
}


@pytest.mark.parametrize("name", list(FORMERLY_KNOWN))
def test_a_formerly_known_disagreement_agrees(bench: MultiBench, name: str) -> None:
    """The claims issue 49 item 6 found the policies and the node disagreeing on, one of
    each kind (held as strict xfails until the claim-wide rules were generated)."""
    case = FORMERLY_KNOWN[name]
    policy = policy_verdict(bench.clients[0], bench.namespace, case, bench.classes)
    answer = node_verdict(case)
    assert disagreement(case, policy, answer) is None, f"{name}: policy {policy}, node {answer}"
