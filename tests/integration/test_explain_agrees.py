"""`kubectl gpu why` agrees with the real kube-scheduler, trial after random trial.

Three profiles of simulated nodes, their ResourceSlices written once as the driver
publishes them (`controller.slices.desired_slices`), under a driver name of this module's
own with DeviceClasses of its own, each node labelled with its profile:
- nvlink: an 8-GPU NVLink ring, two bridged NVLink triangles and an 8-GPU NVSwitch board
  (list-type attributes published): whole GPUs, linked sets in both documented shapes;
- shares: two HGX H200 boards with memory shares: whole GPUs, linked sets, shares;
- mig: two HGX H200 MIG boards (dynamic MIG and memory shares): MIG placements, whole GPUs,
  shares.
Each trial (seeded) fills the profile's nodes at random with single, linked, share, MIG and
adminAccess claims, allocated cheaply: each claim's `status.allocation` is written directly
(valid by construction: free devices, counters left, capacity left; an adminAccess claim
takes any GPU, as it holds none), with no pod and no scheduling. Some trials first put
DeviceTaintRules on a device or a whole node (NoSchedule, or the effect None that does not
count), and some probes tolerate them or ask for adminAccess.
Then the probe claim and its pod (pinned to the profile by a nodeSelector, held back by a
scheduling gate) are created, the explanation is read exactly as `kubectl gpu why` reads
it (dra_driver.commands.why.read_report), the gate is lifted, and the scheduler answers:
the pod is bound, or its PodScheduled condition says Unschedulable. Whenever the
explanation says a node can hold the claim, the scheduler must bind it, on such a node;
whenever it says none can, the pod must stay pending. Every disagreement is a failure.
Some probes are pinned to one node, so that the verdict on each single node is checked too.
The seeds are new on every run (WHY_SEED fixes the first); a disagreement names its seed.

The probe claim is created after the fills, and the scheduler reads both from one claim
watch, so by the time it can schedule the pod (it waits for the claim) it has seen every
fill: the state it decides on is the one explained. DeviceTaintRules come through a watch of
their own: they are written before the fills and given RULE_SETTLE_S to arrive.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from controller.claim_shapes import linked_gpus_ga, linked_gpus_list
from controller.slices import SliceFeatures, desired_slices
from dra_driver import kube
from dra_driver.commands.why import read_report
from dra_driver.explain.celenv import parse_quantity
from dra_driver.gpu import discover
from dra_driver.jsontypes import JSON
from tests.harness.bodies import claim_body, claim_pod
from tests.harness.cluster import ControlPlane
from tests.harness.objects import RESOURCE_API, create_node, get_pod, sync_request, wait_for

pytestmark = pytest.mark.integration

SUFFIX = uuid.uuid4().hex[:6]
DRIVER = f"why-{SUFFIX}.dra-driver.dev"
A = f'device.attributes["{DRIVER}"]'
CLASSES = {
    "gpu": f"why-{SUFFIX}-gpu",
    "share": f"why-{SUFFIX}-share",
    "mig": f"why-{SUFFIX}-mig",
}
CLASS_EXPRESSIONS = {
    "gpu": f'device.driver == "{DRIVER}" && {A}.type == "gpu"',
    "share": f'device.driver == "{DRIVER}" && {A}.type == "gpu-share"',
    "mig": f'device.driver == "{DRIVER}" && {A}.type == "mig" && !("uuid" in {A})',
}
LABEL = "why-test/profile"
SLICES = f"{RESOURCE_API}/resourceslices"
TRIALS = int(os.environ.get("WHY_TRIALS", "70"))  # per profile
SEED = int(os.environ.get("WHY_SEED") or random.SystemRandom().randrange(1_000_000))
RULES = "why-test/rules"  # the label of this module's DeviceTaintRules
TAINT_KEY = "why-test/maintenance"
RULE_SETTLE_S = 0.5  # for the scheduler's DeviceTaintRule watch, written before a trial's fills
ADMIN_NAMESPACE = {"resource.kubernetes.io/admin-access": "true"}
MIG_PROFILES = ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb")

PROFILES: dict[str, list[tuple[str, str, SliceFeatures]]] = {
    "nvlink": [
        ("ring", "ring8-v100", SliceFeatures(list_attributes=True)),
        ("tri", "bridged-triangles-v100", SliceFeatures(list_attributes=True)),
        ("nvs", "hgx-h200", SliceFeatures(list_attributes=True)),
    ],
    "shares": [
        ("h200a", "hgx-h200", SliceFeatures(memory_shares=True)),
        ("h200b", "hgx-h200", SliceFeatures(memory_shares=True)),
    ],
    "mig": [
        ("miga", "hgx-h200-mig", SliceFeatures(dynamic_mig=True, memory_shares=True)),
        ("migb", "hgx-h200-mig", SliceFeatures(dynamic_mig=True, memory_shares=True)),
    ],
}


# --------------------------------------------------------------------------- the fleet


@dataclass
class Fleet:
    api: client.ApiClient
    kubeconfig: str
    nodes: dict[str, list[str]]  # profile -> node names
    devices: dict[str, list[JSON]] = field(default_factory=dict)  # node -> its slice devices
    counters: dict[str, dict[str, dict[str, Decimal]]] = field(default_factory=dict)  # node -> sets
    rules: str | None = None  # where DeviceTaintRules are served; None: nowhere


def _rules_path(api: client.ApiClient) -> str | None:
    for version in ("v1", "v1beta2", "v1alpha3"):
        path = f"/apis/resource.k8s.io/{version}/devicetaintrules"
        try:
            sync_request(api, "GET", path, query={"limit": "1"})
            return path
        except ApiException as e:
            if e.status != 404:
                raise
    return None


@pytest.fixture(scope="module")
def fleet(control_plane: ControlPlane, api: client.ApiClient) -> Iterator[Fleet]:
    for kind, name in CLASSES.items():
        sync_request(
            api,
            "POST",
            f"{RESOURCE_API}/deviceclasses",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": name},
                "spec": {"selectors": [{"cel": {"expression": CLASS_EXPRESSIONS[kind]}}]},
            },
        )
    f = Fleet(api, str(control_plane.kubeconfig), {}, rules=_rules_path(api))
    try:
        for profile, members in PROFILES.items():
            for short, hardware, features in members:
                node = f"why-{short}-{SUFFIX}"
                f.nodes.setdefault(profile, []).append(node)
                create_node(api, node, labels={LABEL: profile})
                specs = desired_slices(discover(hardware), node, DRIVER, features)
                f.devices[node], f.counters[node] = [], {}
                for n, spec in enumerate(specs):
                    spec["pool"] = {**spec["pool"], "generation": 1, "resourceSliceCount": len(specs)}
                    sync_request(
                        api,
                        "POST",
                        SLICES,
                        {
                            "apiVersion": "resource.k8s.io/v1",
                            "kind": "ResourceSlice",
                            "metadata": {"name": f"{node}-{n}"},
                            "spec": spec,
                        },
                    )
                    f.devices[node].extend(spec.get("devices") or [])
                    for cs in spec.get("sharedCounters") or []:
                        f.counters[node][cs["name"]] = {
                            k: parse_quantity(v["value"]) for k, v in cs["counters"].items()
                        }
        yield f
    finally:
        sync_request(api, "DELETE", SLICES, query={"fieldSelector": f"spec.driver={DRIVER}"})
        if f.rules:
            sync_request(api, "DELETE", f.rules, query={"labelSelector": f"{RULES}={SUFFIX}"})
        for nodes in f.nodes.values():
            for node in nodes:
                sync_request(api, "DELETE", f"/api/v1/nodes/{node}")
        for name in CLASSES.values():
            sync_request(api, "DELETE", f"{RESOURCE_API}/deviceclasses/{name}")


# --------------------------------------------------------------------------- random fills


def _attr(device: JSON, name: str) -> Any:
    value = device.get("attributes", {}).get(name) or {}
    return next(iter(value.values()), None)


class Filler:
    """Allocations that are valid by construction, tracked as the allocator counts them:
    devices held whole, shares' consumed capacity, counters of every allocated device."""

    def __init__(self, fleet: Fleet, nodes: list[str], rng: random.Random) -> None:
        self.fleet, self.nodes, self.rng = fleet, nodes, rng
        self.whole: set[tuple[str, str]] = set()
        self.admin_fills = 0
        self.shared: dict[tuple[str, str], Decimal] = {}
        self.left = {n: {s: dict(c) for s, c in fleet.counters[n].items()} for n in nodes}

    def _free(self, node: str, device: JSON) -> bool:
        key = (node, device["name"])
        if key in self.whole:
            return False
        if device.get("allowMultipleAllocations") and key in self.shared:
            return True  # its counters are taken once, by its first share
        return all(
            self.left[node][c["counterSet"]][k] >= parse_quantity(v["value"])
            for c in device.get("consumesCounters") or []
            for k, v in c["counters"].items()
        )

    def _take(self, node: str, device: JSON, memory: Decimal | None = None) -> None:
        key = (node, device["name"])
        if memory is None:
            self.whole.add(key)
        elif key in self.shared:
            self.shared[key] += memory
            return
        else:
            self.shared[key] = memory
        for c in device.get("consumesCounters") or []:
            for k, v in c["counters"].items():
                self.left[node][c["counterSet"]][k] -= parse_quantity(v["value"])

    def _of(self, node: str, kind: str) -> list[JSON]:
        """The node's devices of a type ("gpu", "gpu-share", "mig": placements only) with room."""
        return [
            d
            for d in self.fleet.devices[node]
            if _attr(d, "type") == kind
            and not (kind == "mig" and "uuid" in d["attributes"])
            and self._free(node, d)
        ]

    def claim(self) -> tuple[str, list[tuple[str, str, JSON | None]]] | None:
        """A random fill: (node, [(request, device, consumed)]) or None when it found no room."""
        node = self.rng.choice(self.nodes)
        kind = self.rng.choice(["single", "single", "linked", "share", "mig", "admin"])
        if kind == "admin":  # holds nothing: any GPU, held or not, and nothing taken
            gpus = [d for d in self.fleet.devices[node] if _attr(d, "type") == "gpu"]
            chosen = self.rng.sample(gpus, self.rng.randint(1, min(3, len(gpus))))
            self.admin_fills += 1
            return node, [("watch", d["name"], None) for d in chosen]
        if kind == "single":
            free = self._of(node, "gpu")
            if not free:
                return None
            d = self.rng.choice(free)
            self._take(node, d)
            return node, [("gpu", d["name"], None)]
        if kind == "linked":
            free = self._of(node, "gpu")
            groups: dict[str, list[JSON]] = {}
            for d in free:
                for layer in range(8):
                    value = _attr(d, f"nvlinkClique{layer}")
                    if value:
                        groups.setdefault(f"{layer}:{value}", []).append(d)
            pairs = [g for g in groups.values() if len(g) >= 2]
            if not pairs:
                return None
            group = self.rng.choice(pairs)
            chosen = self.rng.sample(group, self.rng.randint(2, min(4, len(group))))
            for d in chosen:
                self._take(node, d)
            return node, [("gpus", d["name"], None) for d in chosen]
        if kind == "share":
            gi = Decimal(2**30)
            memory = self.rng.choice([8, 16, 40, 64, 100]) * gi
            fits = [
                d
                for d in self._of(node, "gpu-share")
                if self.shared.get((node, d["name"]), Decimal(0)) + memory
                <= parse_quantity(d["capacity"]["memory"]["value"])
            ]
            if not fits:
                return None
            d = self.rng.choice(fits)
            self._take(node, d, memory)
            return node, [("mem", d["name"], {"memory": f"{int(memory // gi)}Gi"})]
        free = self._of(node, "mig")
        if not free:
            return None
        d = self.rng.choice(free)
        self._take(node, d)
        return node, [("mig", d["name"], None)]


# --------------------------------------------------------------------------- probes


def _probe(profile: str, rng: random.Random) -> tuple[str, JSON]:
    """A random claim of the kinds the profile serves: (description, spec.devices)."""
    gpu, share, mig = CLASSES["gpu"], CLASSES["share"], CLASSES["mig"]
    choices = ["single", "linked", "admin"]
    if profile == "nvlink":
        choices += ["linked-list", "linked"]
    if profile in ("shares", "mig"):
        choices += ["share"]
    if profile == "mig":
        choices += ["mig", "mig", "mig-pair"]
    kind = rng.choice(choices)
    if kind == "single":
        n = rng.choice([1, 1, 2, 3, 5, 8])
        return f"{n} GPUs", {"requests": [{"name": "gpu", "exactly": {"deviceClassName": gpu, "count": n}}]}
    if kind == "admin":
        n = rng.choice([1, 2, 3, 9])
        exactly = {"deviceClassName": gpu, "count": n, "adminAccess": True}
        return f"{n} GPUs with adminAccess", {"requests": [{"name": "gpu", "exactly": exactly}]}
    if kind == "linked":
        k = rng.choice([2, 2, 3, 4, 6])
        return f"{k} linked (GA)", linked_gpus_ga(k, driver=DRIVER, device_class=gpu)
    if kind == "linked-list":
        k = rng.choice([2, 3, 4])
        return f"{k} linked (list)", linked_gpus_list(k, driver=DRIVER, device_class=gpu)
    if kind == "share":
        gi = rng.choice([8, 40, 64, 100, 140])
        exactly = {"deviceClassName": share, "capacity": {"requests": {"memory": f"{gi}Gi"}}}
        return f"share {gi}Gi", {"requests": [{"name": "mem", "exactly": exactly}]}
    profile_name = rng.choice(MIG_PROFILES)
    selectors = [{"cel": {"expression": f'{A}.profile == "{profile_name}"'}}]
    if kind == "mig":
        return f"MIG {profile_name}", {
            "requests": [{"name": "mig", "exactly": {"deviceClassName": mig, "selectors": selectors}}]
        }
    return f"2x MIG {profile_name} one GPU", {
        "requests": [
            {"name": "mig", "exactly": {"deviceClassName": mig, "count": 2, "selectors": selectors}}
        ],
        "constraints": [{"requests": ["mig"], "matchAttribute": f"{DRIVER}/parentUUID"}],
    }


def _fill(
    api: client.ApiClient, ns: str, name: str, node: str, taken: list[tuple[str, str, JSON | None]]
) -> None:
    requests: dict[str, int] = Counter(r for r, _, _ in taken)
    first_class = {
        "gpu": CLASSES["gpu"],
        "gpus": CLASSES["gpu"],
        "mem": CLASSES["share"],
        "mig": CLASSES["mig"],
        "watch": CLASSES["gpu"],
    }
    devices: JSON = {
        "requests": [
            {
                "name": r,
                "exactly": {"deviceClassName": first_class[r], "count": n}
                | ({"adminAccess": True} if r == "watch" else {}),
            }
            for r, n in requests.items()
        ]
    }
    if "mem" in requests:
        memory = next(c for _, _, c in taken if c)["memory"]
        devices["requests"][0]["exactly"]["capacity"] = {"requests": {"memory": memory}}
    claim = sync_request(
        api, "POST", f"{RESOURCE_API}/namespaces/{ns}/resourceclaims", claim_body(name, devices)
    )
    results = []
    for request, device, consumed in taken:
        result: JSON = {"request": request, "driver": DRIVER, "pool": node, "device": device}
        if request == "watch":
            result["adminAccess"] = True
        if consumed:
            result["shareID"] = str(uuid.uuid4())
            result["consumedCapacity"] = consumed
        results.append(result)
    claim["status"] = {
        "allocation": {
            "devices": {"results": results},
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        }
    }
    sync_request(api, "PUT", f"{RESOURCE_API}/namespaces/{ns}/resourceclaims/{name}/status", claim)


def _taint_rules(fleet: Fleet, profile: str, rng: random.Random) -> list[JSON]:
    """None, or one or two DeviceTaintRules on a random device or a whole node of the profile."""
    if not fleet.rules or rng.random() >= 0.35:
        return []
    rules = []
    for _ in range(rng.randint(1, 2)):
        node = rng.choice(fleet.nodes[profile])
        kind = rng.choice(["device", "device", "node", "no effect"])
        selector: JSON = {"driver": DRIVER, "pool": node}
        if kind != "node":
            selector["device"] = rng.choice(fleet.devices[node])["name"]
        rules.append({
            "metadata": {"generateName": "why-", "labels": {RULES: SUFFIX}},
            "spec": {
                "deviceSelector": selector,
                "taint": {"key": TAINT_KEY, "value": kind.replace(" ", "-"),
                          "effect": "None" if kind == "no effect" else "NoSchedule"},
            },
        })
    return rules


def _tolerating(devices: JSON) -> JSON:
    """The claim's requests (and subrequests) tolerating TAINT_KEY."""
    toleration = [{"key": TAINT_KEY, "operator": "Exists"}]
    for r in devices["requests"]:
        for body in [r["exactly"]] if "exactly" in r else r["firstAvailable"]:
            body["tolerations"] = toleration
    return devices


def _json_patch(api: client.ApiClient, path: str, ops: list[JSON]) -> None:
    params = api.param_serialize(
        method="PATCH",
        resource_path=path,
        body=ops,
        auth_settings=["BearerToken"],
        header_params={"Content-Type": "application/json-patch+json", "Accept": "application/json"},
    )
    response = api.call_api(*params)
    data = response.read()
    if response.status >= 400:
        raise AssertionError(f"PATCH {path}: {response.status} {data.decode(errors='replace')}")
    json.loads(data)


def _clear(api: client.ApiClient, ns: str, rules: str | None) -> None:
    if rules:
        sync_request(api, "DELETE", rules, query={"labelSelector": f"{RULES}={SUFFIX}"})
    sync_request(api, "DELETE", f"/api/v1/namespaces/{ns}/pods", query={"gracePeriodSeconds": "0"})
    sync_request(api, "DELETE", f"{RESOURCE_API}/namespaces/{ns}/resourceclaims")

    def gone() -> bool:
        claims = sync_request(api, "GET", f"{RESOURCE_API}/namespaces/{ns}/resourceclaims")["items"]
        pods = sync_request(api, "GET", f"/api/v1/namespaces/{ns}/pods")["items"]
        return not claims and not pods

    wait_for("the trial's claims and pods to be gone", gone, timeout=60)


def _scheduler_answer(api: client.ApiClient, ns: str, pod: str) -> tuple[str, str]:
    """("bound", node) or ("pending", the scheduler's message)."""

    def answered() -> tuple[str, str] | None:
        p = get_pod(api, ns, pod)
        if p["spec"].get("nodeName"):
            return "bound", p["spec"]["nodeName"]
        for c in (p.get("status") or {}).get("conditions") or []:
            # only the claims' refusal counts: "resourceclaim not found" (the scheduler's cache
            # behind) is retried by the scheduler
            if (
                c.get("type") == "PodScheduled"
                and c.get("reason") == "Unschedulable"
                and "cannot allocate all claims" in c.get("message", "")
            ):
                return "pending", c.get("message", "")
        return None

    return wait_for(f"the scheduler's answer for {pod}", answered, timeout=60, interval=0.05)


async def _explain(kubeconfig: str, ns: str, pod: str) -> tuple[tuple[str, ...], str]:
    api = await kube.load_client(kubeconfig)
    try:
        report = await read_report(api, ns, pod)
    finally:
        await api.close()
    from dra_driver.explain.render import render

    bad = [n for n in report.nodes if n.verdict in ("undecided", "refused")]
    assert not bad, f"the explanation could not decide: {[n.summary for n in bad]}"
    return report.fitting, render(report, verbose=True)


@pytest.mark.parametrize("profile", list(PROFILES))
def test_the_explanation_agrees_with_the_scheduler(
    fleet: Fleet, namespace: str, profile: str, capsys: pytest.CaptureFixture[str]
) -> None:
    api = fleet.api
    sync_request(api, "PATCH", f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": ADMIN_NAMESPACE}},
                 content_type="application/merge-patch+json")
    verdicts: Counter[str] = Counter()
    seen: Counter[str] = Counter()  # trials with DeviceTaintRules, with adminAccess
    disagreements: list[str] = []
    started = time.monotonic()
    first_seed = SEED + 1000 * list(PROFILES).index(profile)
    for trial in range(TRIALS):
        seed = first_seed + trial
        rng = random.Random(seed)
        filler = Filler(fleet, fleet.nodes[profile], rng)
        rules = _taint_rules(fleet, profile, rng)
        for rule in rules:
            version = str(fleet.rules).split("/")[3]  # /apis/resource.k8s.io/<version>/devicetaintrules
            body = {"apiVersion": f"resource.k8s.io/{version}", "kind": "DeviceTaintRule", **rule}
            sync_request(api, "POST", str(fleet.rules), body)
        settle = time.monotonic() + (RULE_SETTLE_S if rules else 0)
        fills = 0
        for attempt in range(rng.randint(0, 24)):
            found = filler.claim()
            if found:
                _fill(api, namespace, f"fill{attempt}", *found)
                fills += 1
        what, devices = _probe(profile, rng)
        if rules:
            on = [r["spec"]["deviceSelector"] for r in rules]
            taints = ", ".join(f"{s.get('device', s['pool'])} {r['spec']['taint']['effect']}"
                               for s, r in zip(on, rules, strict=True))
            what += f", DeviceTaintRules on {taints}"
            seen["DeviceTaintRules"] += 1
            if rng.random() < 0.3:
                devices = _tolerating(devices)
                what += ", tolerated"
        if any(r.get("exactly", {}).get("adminAccess") for r in devices["requests"]):
            seen["adminAccess probe"] += 1
        if filler.admin_fills:
            seen["adminAccess fills"] += 1
        time.sleep(max(0.0, settle - time.monotonic()))
        # Some probes are pinned to one node: then the verdict on that very node is checked.
        selector = {LABEL: profile}
        if rng.random() < 0.4:
            selector["kubernetes.io/hostname"] = rng.choice(fleet.nodes[profile])
            what += f" on {selector['kubernetes.io/hostname']}"
        sync_request(
            api,
            "POST",
            f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims",
            claim_body("probe", devices),
        )
        probe = claim_pod("probe", {"resourceClaimName": "probe"})
        probe["spec"] |= {"schedulingGates": [{"name": "why-test/explain-first"}], "nodeSelector": selector}
        sync_request(api, "POST", f"/api/v1/namespaces/{namespace}/pods", probe)
        fitting, text = asyncio.run(_explain(fleet.kubeconfig, namespace, "probe"))
        _json_patch(
            api,
            f"/api/v1/namespaces/{namespace}/pods/probe",
            [{"op": "remove", "path": "/spec/schedulingGates"}],
        )
        answer, detail = _scheduler_answer(api, namespace, "probe")
        if answer == "bound" and detail in fitting:
            verdicts["fits: bound there"] += 1
        elif answer == "pending" and not fitting:
            verdicts["fits nowhere: pending"] += 1
        else:
            said = f"fits on {', '.join(fitting)}" if fitting else "fits nowhere"
            verdicts["disagreement"] += 1
            disagreements.append(
                f"seed {seed} ({what}, {fills} fills): explanation {said}; scheduler: "
                f"{answer} {detail}\n{text}"
            )
        _clear(api, namespace, fleet.rules if rules else None)
        if rules:
            time.sleep(RULE_SETTLE_S)  # the next trial's scheduler must not see them
    elapsed = time.monotonic() - started
    with capsys.disabled():  # shown by `make test` (pytest -q) too
        print(
            f"\n[why-agreement] profile {profile}: {TRIALS} trials, "
            f"seeds {first_seed}..{first_seed + TRIALS - 1}, {elapsed:.0f} s; "
            f"verdicts: {dict(sorted(verdicts.items()))}; trials with {dict(sorted(seen.items()))}"
        )
    assert not disagreements, "\n\n".join(disagreements[:3])
    # A check that only ever sees one answer could not fail on the other.
    assert verdicts["fits: bound there"] and verdicts["fits nowhere: pending"], verdicts
