"""Hand-written odd claim configs, of the kinds users write (issue 49's acceptance): each is
refused when the claim or class is written, with a message that names the fix, or runs as
meant. None may be admitted and then stuck on the node, none may run silently otherwise.

The policies: the chart's (claim-config, memory-shares, consumable-shares), as
test_claim_agreement_multi.py renders and installs them on a real API server (dry-run writes:
each class with a config first, then the claim). The node: that module's simulated node and
the plugin's own `ClaimSteps.plan` on every allocation the scheduler may make.

Refused: the policies refuse at creation and the message holds the fix's words. Runs: the
policies admit it and every allocation plans, and the plan is what the config asks for (MPS
or not, the thread percentage, the pinned limits, the /dev/shm size).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client

from dra_driver.plugin.claims import ClaimRef, ClaimRejected
from dra_driver.sharing.config import DEFAULT_SHM_SIZE
from tests.harness.cluster import ControlPlane
from tests.harness.objects import RESOURCE_API, create_namespace, sync_request
from tests.integration.test_claim_agreement_multi import (
    DRIVER,
    MIG,
    MIG_DYN,
    NV,
    OURS,
    SHARE,
    WHOLE,
    Case,
    MultiBench,
    _choices,
    _dry_run,
    allocated,
    bench,
    node,
    policy_verdict,
)

__all__ = ["bench"]  # the fixture, shared with the module it comes from

GI = 2**30
ANY: Any = object()  # a field of Runs not looked at


@dataclass(frozen=True)
class Refused:
    fix: str  # words of the refusal that say what to change


@dataclass(frozen=True)
class Runs:
    mps: bool
    percentage: Any = ANY  # the daemon's active-thread percentage
    limits: Any = ANY  # the pinned limits of the MPS devices, sorted (None: no limit)
    shm: Any = ANY  # bytes of /dev/shm


def _req(
    name: str, cls: str, count: int | None = None, memory: str | None = None, **more: Any
) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": cls, **more}
    if count is not None:
        exactly["count"] = count
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    return {"name": name, "exactly": exactly}


def _alts(name: str, *subs: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "firstAvailable": [{"name": s["name"], **s["exactly"]} for s in subs]}


def _entry(params: Any, *requests: str, driver: str = DRIVER) -> dict[str, Any]:
    out: dict[str, Any] = {"opaque": {"driver": driver, "parameters": params}}
    if requests:
        out["requests"] = list(requests)
    return out


def ours(**sharing: Any) -> dict[str, Any]:
    return {"apiVersion": OURS, "kind": "GpuConfig", **({"sharing": sharing} if sharing else {})}


def nvidia(kind: str = "GpuConfig", **sharing: Any) -> dict[str, Any]:
    return {"apiVersion": NV, "kind": kind, **({"sharing": sharing} if sharing else {})}


def claim(*requests: dict[str, Any], config: tuple[dict[str, Any], ...] = (),
          classes: dict[str, list[dict[str, Any]]] | None = None) -> Case:
    devices: dict[str, Any] = {"requests": list(requests)}
    if config:
        devices["config"] = list(config)
    return Case(devices, classes or {})


GPU = "all of the GPU's memory"  # a limit of Runs: the simulated GPU's memory in whole MiB

ODD: dict[str, tuple[Case, Refused | Runs]] = {
    # a DeviceClass carrying its own config
    "class: an interval the node refuses": (
        claim(_req("a", WHOLE), classes={WHOLE: [_entry(nvidia(strategy="TimeSlicing",
                                                              timeSlicingConfig={"interval": "Long"}))]}),
        Refused("remove interval or write Default")),
    "class: GpuConfig on the MIG class": (
        claim(_req("a", MIG), classes={MIG: [_entry(nvidia())]}), Refused("use kind MigDeviceConfig")),
    "class: time-slicing on the share class": (
        claim(_req("a", SHARE, memory="4Gi"), classes={SHARE: [_entry(ours(strategy="TimeSlicing"))]}),
        Refused("set strategy MPS")),
    "class: a share limit above the smallest share": (
        claim(_req("a", SHARE, memory="8Gi"),
              classes={SHARE: [_entry(ours(strategy="MPS", mps={"defaultPinnedDeviceMemoryLimit": "4Gi"}))]}),
        Refused("remove defaultPinnedDeviceMemoryLimit")),
    "class: a per-device index beyond one device": (
        claim(_req("a", WHOLE), classes={WHOLE: [_entry(nvidia(strategy="MPS", mpsConfig={
            "defaultPerDevicePinnedMemoryLimit": {"1": "10Gi"}}))]}),
        Refused("use an index from 0 to 0")),
    # a class's config together with the claim's (the class-config policy)
    "class: a thread percentage, the claim another for its other request": (
        claim(_req("a", WHOLE), _req("b", SHARE, memory="4Gi"),
              config=(_entry(ours(strategy="MPS", mps={"defaultActiveThreadPercentage": 60}), "b"),),
              classes={WHOLE: [_entry(ours(strategy="MPS", mps={"defaultActiveThreadPercentage": 40}))]}),
        Refused("give every MPS config of the claim the same one")),
    "class: a thread percentage, the claim's for all requests overrides it": (
        claim(_req("a", WHOLE), _req("b", WHOLE),
              config=(_entry(ours(strategy="MPS", mps={"defaultActiveThreadPercentage": 60})),),
              classes={WHOLE: [_entry(ours(strategy="MPS", mps={"defaultActiveThreadPercentage": 40}))]}),
        Runs(mps=True, percentage=60, limits=[None, None])),
    "class: a thread percentage on a firstAvailable alternative, the claim another": (
        claim(_alts("a", _req("x", MIG), _req("y", WHOLE)), _req("b", SHARE, memory="4Gi"),
              config=(_entry(nvidia(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 30}), "b"),),
              classes={WHOLE: [_entry(nvidia(strategy="MPS",
                                             mpsConfig={"defaultActiveThreadPercentage": 50}))]}),
        Refused("give every MPS config of the claim the same one")),
    "class: per-device limits, a claim index counted over the claim config's own devices": (
        claim(_req("a", WHOLE, count=2), _req("b", SHARE, memory="4Gi"),
              config=(_entry(nvidia(strategy="MPS",
                                    mpsConfig={"defaultPerDevicePinnedMemoryLimit": {"2": "1Gi"}}), "b"),),
              classes={WHOLE: [_entry(nvidia(strategy="MPS", mpsConfig={
                  "defaultActiveThreadPercentage": 50,
                  "defaultPerDevicePinnedMemoryLimit": {"0": "10Gi"}}))]}),
        Refused("use an index from 0 to 0")),
    "class: the share class's limit and thread percentage, the claim another percentage": (
        claim(_req("a", SHARE, memory="1Gi"), _req("b", WHOLE),
              config=(_entry(ours(strategy="MPS", mps={"defaultActiveThreadPercentage": 20}), "b"),),
              classes={SHARE: [_entry(ours(strategy="MPS", mps={"defaultPinnedDeviceMemoryLimit": "1Gi",
                                                                "defaultActiveThreadPercentage": 30}))]}),
        Refused("give every MPS config of the claim the same one")),
    "two classes, two thread percentages": (
        claim(_req("a", WHOLE), _req("b", SHARE, memory="4Gi"),
              classes={WHOLE: [_entry(ours(strategy="MPS", mps={"defaultActiveThreadPercentage": 40}))],
                       SHARE: [_entry(ours(strategy="MPS", mps={"defaultActiveThreadPercentage": 60}))]}),
        Refused("give the two classes the same one")),
    "class: MPS with a thread percentage": (
        claim(_req("a", WHOLE),
              classes={WHOLE: [_entry(ours(strategy="MPS", mps={"defaultActiveThreadPercentage": 40}))]}),
        Runs(mps=True, percentage=40, limits=[None])),
    # contradictions visible in one claim
    "two requests, two thread percentages": (
        claim(_req("a", WHOLE), _req("b", WHOLE), config=(
            _entry(ours(strategy="MPS", mps={"defaultActiveThreadPercentage": 25}), "a"),
            _entry(ours(strategy="MPS", mps={"defaultActiveThreadPercentage": 50}), "b"))),
        Refused("give every MPS config of the claim the same one")),
    "two requests, one thread percentage twice": (
        claim(_req("a", WHOLE), _req("b", WHOLE), config=(
            _entry(ours(strategy="MPS", mps={"defaultActiveThreadPercentage": 50}), "a"),
            _entry(nvidia(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 50}), "b"))),
        Runs(mps=True, percentage=50, limits=[None, None])),
    "a per-device index beyond the request's count": (
        claim(_req("a", WHOLE, count=2), config=(_entry(nvidia(strategy="MPS", mpsConfig={
            "defaultPerDevicePinnedMemoryLimit": {"2": "10Gi"}}), "a"),)),
        Refused("use an index from 0 to 1")),
    "a per-device index within the count": (
        claim(_req("a", WHOLE, count=2), config=(_entry(nvidia(strategy="MPS", mpsConfig={
            "defaultPinnedDeviceMemoryLimit": "20Gi",
            "defaultPerDevicePinnedMemoryLimit": {"1": "10Gi"}}), "a"),)),
        Runs(mps=True, limits=[10 * GI, 20 * GI])),
    "a per-device index on the MIG slices of a count beyond": (
        claim(_req("a", MIG_DYN, count=2),
              config=(_entry(nvidia("MigDeviceConfig", strategy="MPS", mpsConfig={
            "defaultPerDevicePinnedMemoryLimit": {"3": "1Gi"}})),)),
        Refused("use an index from 0 to 1")),
    "a share's limit above the share": (
        claim(_req("a", SHARE, memory="4Gi"), config=(
            _entry(ours(strategy="MPS", mps={"defaultPinnedDeviceMemoryLimit": "10Gi"})),)),
        Refused("remove defaultPinnedDeviceMemoryLimit (the share's size is its limit)")),
    "a default 8Gi share's limit above it": (
        claim(_req("a", SHARE), config=(_entry(nvidia(strategy="MPS", mpsConfig={
            "defaultPinnedDeviceMemoryLimit": "10Gi"})),)),
        Refused("or ask for more memory")),
    "a share's limit below the share": (
        claim(_req("a", SHARE, memory="4Gi"), config=(
            _entry(ours(strategy="MPS", mps={"defaultPinnedDeviceMemoryLimit": "2Gi"})),)),
        Runs(mps=True, limits=[2 * GI])),
    "a share with MPS and mps: null": (
        claim(_req("a", SHARE, memory="40Gi"), config=(_entry(ours(strategy="MPS", mps=None), "a"),)),
        Runs(mps=True, limits=[40 * GI])),
    "time-slicing for a share": (
        claim(_req("a", SHARE, memory="8Gi"), config=(_entry(nvidia(strategy="TimeSlicing")),)),
        Refused("set strategy MPS")),
    "adminAccess on a dynamic MIG slice": (
        claim(_req("a", MIG_DYN, adminAccess=True)),
        Refused("ask for a static MIG device")),
    "adminAccess on the MIG class, which offers slices too": (
        claim(_req("a", MIG, adminAccess=True)), Refused("add the selector")),
    "adminAccess on the MIG class, MIG devices already made": (
        claim(_req("a", MIG, adminAccess=True, selectors=[
            {"cel": {"expression": f'"uuid" in device.attributes["{DRIVER}"]'}}])),
        Runs(mps=False)),
    "firstAvailable of both kinds, one NVIDIA kind for the request": (
        claim(_alts("a", _req("x", WHOLE), _req("y", MIG)), config=(_entry(nvidia("MigDeviceConfig"), "a"),)),
        Refused("a firstAvailable alternative can have a config entry of its own (requests: [a/x])")),
    "firstAvailable of both kinds, a kind for each alternative": (
        claim(_alts("a", _req("x", WHOLE), _req("y", MIG)), config=(
            _entry(nvidia(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 30}), "a/x"),
            _entry(nvidia("MigDeviceConfig", strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 30}),
                   "a/y"))),
        Runs(mps=True, percentage=30, limits=[None])),
    "firstAvailable share alternative, a limit above it": (
        claim(_alts("a", _req("x", SHARE, memory="4Gi"), _req("y", WHOLE)), config=(
            _entry(ours(strategy="MPS", mps={"defaultPinnedDeviceMemoryLimit": "10Gi"}), "a"),)),
        Refused("remove defaultPinnedDeviceMemoryLimit")),
    # limits no device of the class can honour
    "a pinned limit of 2Ti": (
        claim(_req("a", WHOLE),
              config=(_entry(ours(strategy="MPS", mps={"defaultPinnedDeviceMemoryLimit": "2Ti"})),)),
        Refused("must be a quantity from 1Mi to 1Ti")),
    "a pinned limit above the GPU's memory": (
        claim(_req("a", WHOLE), config=(_entry(nvidia(strategy="MPS", mpsConfig={
            "defaultPinnedDeviceMemoryLimit": "200Gi"})),)),
        Runs(mps=True, limits=[GPU])),  # all of the GPU's memory: what the limit means there
    "shmSize 1Ti": (
        claim(_req("a", WHOLE), config=(_entry(ours(strategy="MPS", mps={"shmSize": "1Ti"})),)),
        Runs(mps=True, shm=2**40)),  # a tmpfs's size is a bound, its pages are taken as written
    "shmSize 2Ti": (
        claim(_req("a", WHOLE), config=(_entry(ours(strategy="MPS", mps={"shmSize": "2Ti"})),)),
        Refused("the size of the claim's /dev/shm tmpfs")),
    # NVIDIA's forms
    "an empty timeSlicingConfig (interval removed, kubectl create)": (
        claim(_req("a", WHOLE), config=(_entry(nvidia(strategy="TimeSlicing", timeSlicingConfig=None)),)),
        Runs(mps=False)),
    "timeSlicingConfig {}": (
        claim(_req("a", WHOLE), config=(_entry(nvidia(strategy="TimeSlicing", timeSlicingConfig={})),)),
        Runs(mps=False)),
    "sharing: null": (
        claim(_req("a", WHOLE), config=(_entry({"apiVersion": NV, "kind": "GpuConfig", "sharing": None}),)),
        Runs(mps=False)),
    "mpsConfig: null": (
        claim(_req("a", WHOLE), config=(_entry(nvidia(strategy="MPS", mpsConfig=None)),)),
        Runs(mps=True, percentage=None, limits=[None], shm=DEFAULT_SHM_SIZE)),
    "mpsConfig {}": (
        claim(_req("a", WHOLE), config=(_entry(nvidia(strategy="MPS", mpsConfig={})),)),
        Runs(mps=True, percentage=None, limits=[None])),
    "a config left under NVIDIA's driver name": (
        claim(_req("a", WHOLE), config=(_entry(nvidia(strategy="MPS"), driver="gpu.nvidia.com"),)),
        Refused(f"change opaque.driver to {DRIVER}")),
    "two configs for one request: the later wins": (
        claim(_req("a", WHOLE), config=(
            _entry(nvidia(strategy="TimeSlicing"), "a"),
            _entry(nvidia(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 20})))),
        Runs(mps=True, percentage=20)),
    "an entry for every request, overridden for one": (
        claim(_req("a", WHOLE), _req("b", MIG), config=(
            _entry(nvidia(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 60})),
            _entry(nvidia("MigDeviceConfig", strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 60}),
                   "b"))),
        Runs(mps=True, percentage=60, limits=[None, None])),
    "an interval other than Default": (
        claim(_req("a", WHOLE),
              config=(_entry(nvidia(strategy="TimeSlicing", timeSlicingConfig={"interval": "Short"})),)),
        Refused("remove interval or write Default")),
    "multiUser true": (
        claim(_req("a", WHOLE), config=(_entry(nvidia(strategy="MPS", mpsConfig={"multiUser": True})),)),
        Refused("run the claim's containers as one user")),
    "a thread percentage of 0": (
        claim(_req("a", WHOLE),
              config=(_entry(nvidia(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 0})),)),
        Refused("must be a whole number from 1 to 100")),
    "VfioDeviceConfig": (
        claim(_req("a", WHOLE), config=(_entry(nvidia("VfioDeviceConfig")),)),
        Refused("ask for a GPU (kind GpuConfig)")),
    "timeSlicingConfig in a MigDeviceConfig": (
        claim(_req("a", MIG), config=(_entry(nvidia("MigDeviceConfig", strategy="TimeSlicing",
                                                    timeSlicingConfig={"interval": "Default"})),)),
        Refused("is only allowed with strategy TimeSlicing (and only in a GpuConfig)")),
    "ours with NVIDIA's timeSlicing": (
        claim(_req("a", WHOLE),
              config=(_entry(ours(strategy="TimeSlicing", timeSlicing={"interval": "Long"})),)),
        Refused("remove timeSlicing")),
    "a share with MPS and a thread percentage": (
        claim(_req("a", SHARE, memory="20Gi"), config=(_entry(nvidia(strategy="MPS", mpsConfig={
            "defaultActiveThreadPercentage": 35})),)),
        Runs(mps=True, percentage=35, limits=[20 * GI])),
}


@pytest.fixture(scope="module")
def admin_namespace(
    bench: MultiBench, control_plane: ControlPlane, api: client.ApiClient
) -> Iterator[str]:
    """A namespace where adminAccess may be asked for (the API server wants its label)."""
    name = f"odd-admin-{random.randrange(16**6):06x}"
    create_namespace(api, name, {"resource.kubernetes.io/admin-access": "true"})
    try:
        yield name
    finally:
        sync_request(api, "DELETE", f"/api/v1/namespaces/{name}")


def node_plans(case: Case) -> list[Any]:
    """The plugin's plan of every allocation (the sharing part); a refusal fails the test."""
    plans = []
    for choice in _choices(case):
        uid = "4b9e0a3c-0000-4000-8000-0000000000dd"
        try:
            plans.append(node().steps.plan(ClaimRef("ns", "c", uid), allocated(case, choice, uid)).sharing)
        except ClaimRejected as e:
            raise AssertionError(f"admitted, then stuck on the node (allocation {choice}): {e}") from e
    return plans


def _order(limit: int | None) -> tuple[bool, int]:
    return (limit is not None, limit or 0)


def test_at_least_thirty_odd_configs() -> None:
    assert len(ODD) >= 30


@pytest.mark.parametrize("name", list(ODD))
def test_an_odd_config_is_refused_with_its_fix_or_runs_as_meant(
    bench: MultiBench, admin_namespace: str, name: str
) -> None:
    case, meant = ODD[name]
    namespace = admin_namespace if "adminAccess" in str(case.devices) else bench.namespace
    verdict = policy_verdict(bench.clients[0], namespace, case, bench.classes)
    if isinstance(meant, Refused):
        assert not verdict.admitted, f"{name}: admitted, meant to be refused ({meant.fix})"
        assert meant.fix in verdict.message, f"{name}: refused without naming the fix: {verdict.message}"
        return
    assert verdict.admitted, f"{name}: refused, meant to run: {verdict.message}"
    for plan in node_plans(case):
        assert (plan is not None) == meant.mps, f"{name}: MPS {plan is not None}, meant {meant.mps}"
        if plan is None:
            continue
        if meant.percentage is not ANY:
            assert plan.active_thread_percentage == meant.percentage, f"{name}: {plan}"
        if meant.limits is not ANY:
            gpu = node().steps.devices["gpu-0"].gpu.memory_bytes // 2**20 * 2**20
            wanted = sorted((gpu if x == GPU else x for x in meant.limits), key=_order)
            got = sorted((d.pinned_memory_limit for d in plan.devices), key=_order)
            assert got == wanted, f"{name}: {plan}"
        if meant.shm is not ANY:
            assert plan.shm_size == meant.shm, f"{name}: {plan}"


def test_the_largest_claim_is_within_the_policys_cost(bench: MultiBench) -> None:
    """32 requests of 8 alternatives each and 32 config entries (the API's limits), NVIDIA MPS
    configs with per-device limits: the claim-wide rules stay within CEL's cost limit (a cost
    error would refuse every large claim) and refuse it for its one fault, named."""
    alternatives = [_req(s, cls) for s, cls in zip("stuvwxyz", [WHOLE, SHARE, MIG, MIG_DYN] * 2, strict=True)]
    requests = [_alts(f"r{i}", *alternatives) for i in range(32)]
    mps = {"defaultActiveThreadPercentage": 50, "defaultPerDevicePinnedMemoryLimit": {"0": "1Gi"}}
    config = [_entry(nvidia(strategy="MPS", mpsConfig=mps), f"r{i}/s") for i in range(31)]
    case = claim(*requests, config=(*config, _entry(nvidia(strategy="MPS", mpsConfig={
        "defaultActiveThreadPercentage": 60}), "r31/s")))
    verdict = policy_verdict(bench.clients[0], bench.namespace, case, bench.classes)
    assert not verdict.admitted, verdict
    assert "must have the same defaultActiveThreadPercentage" in verdict.message, verdict
    same = claim(*requests, config=tuple(config))
    assert policy_verdict(bench.clients[0], bench.namespace, same, bench.classes).admitted


def test_the_largest_claim_with_class_configs_is_within_the_policys_cost(bench: MultiBench) -> None:
    """The largest claim again, each of its four classes carrying an MPS config with per-device
    limits: the class-config policy, evaluated once per class with the claim-wide rules over the
    class's entries and the claim's, stays within CEL's cost limit and names the one fault."""
    alternatives = [_req(s, cls) for s, cls in zip("stuvwxyz", [WHOLE, SHARE, MIG, MIG_DYN] * 2, strict=True)]
    requests = [_alts(f"r{i}", *alternatives) for i in range(32)]
    mps = {"defaultActiveThreadPercentage": 50, "defaultPerDevicePinnedMemoryLimit": {"0": "1Gi"}}
    classes = {cls: [_entry(nvidia(kind, strategy="MPS", mpsConfig=mps))]
               for cls, kind in ((WHOLE, "GpuConfig"), (SHARE, "GpuConfig"), (MIG, "MigDeviceConfig"),
                                 (MIG_DYN, "MigDeviceConfig"))}
    config = [_entry(nvidia(strategy="MPS", mpsConfig=mps), f"r{i}/s") for i in range(31)]
    case = claim(*requests, config=(*config, _entry(nvidia("MigDeviceConfig", strategy="MPS", mpsConfig={
        "defaultActiveThreadPercentage": 60}), "r31/u")), classes=classes)
    verdict = policy_verdict(bench.clients[0], bench.namespace, case, bench.classes)
    assert not verdict.admitted, verdict
    assert "must have the same defaultActiveThreadPercentage" in verdict.message, verdict
    same = claim(*requests, config=tuple(config), classes=classes)
    assert policy_verdict(bench.clients[0], bench.namespace, same, bench.classes).admitted


def _claim_only(case: Case, meant: Refused | Runs) -> bool:
    return isinstance(meant, Refused) and not case.classes and "adminAccess" not in str(case.devices)


@pytest.mark.parametrize("name", [n for n, (case, meant) in ODD.items() if _claim_only(case, meant)])
def test_a_template_of_an_odd_claim_is_refused_alike(bench: MultiBench, name: str) -> None:
    """A ResourceClaimTemplate is checked as the claims made from it."""
    case, meant = ODD[name]
    assert isinstance(meant, Refused)
    bench.classes.set(case.classes)
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "odd"},
            "spec": {"spec": {"devices": case.devices}}}
    path = f"{RESOURCE_API}/namespaces/{bench.namespace}/resourceclaimtemplates"
    verdict = _dry_run(bench.clients[0], path, body)
    assert verdict is not None and meant.fix in verdict.message, f"{name}: {verdict}"
