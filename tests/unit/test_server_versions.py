"""The publisher against API servers of 1.34 to 1.37 (issue 41), each stood in for by an
in-memory server that keeps, drops or refuses the fields as that version does with its gates.

What must hold on each: the probe finds what the server keeps; a feature whose fields would be
dropped is not published at all (so the scheduler can never allocate a share or a MIG placement
without its counters), and is reported once; counter sets go where the server wants them; a
pool is written once, never rewritten in a loop; a write refused as invalid (422) is logged
whole and not retried twice a second. The real servers are tests/integration/test_versions.py's.
"""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import replace
from typing import Any

import pytest
import structlog

from controller import reconciler
from controller.capabilities import ServerCapabilities, decide, extended_resource_dropped, probe_server
from controller.publisher import pools_for, slice_controller
from controller.reconciler import SliceController
from controller.slices import SliceFeatures, desired_slices
from dra_driver import kube, metrics
from dra_driver.gpu import discover
from dra_driver.jsontypes import JSON
from dra_driver.kube import ApiException
from tests.harness.objects import watch_for_async
from tests.unit.test_publisher_fleet import MemoryApi, settle, watched

DRIVER = "gpu.dra-driver.dev"
NODE = "node-0000"
ASKED = SliceFeatures(memory_shares=True, dynamic_mig=True)

# What each server keeps: (list attributes, taints, consumable capacity, counters layout, version)
SERVERS: dict[str, tuple[bool, bool, bool, str, tuple[int, int]]] = {
    "1.34 default gates": (False, False, False, "none", (1, 34)),
    "1.34 DRA gates on": (False, True, True, "together", (1, 34)),
    "1.35 default gates": (False, False, False, "none", (1, 35)),
    "1.35 DRA gates on": (False, True, True, "apart", (1, 35)),
    "1.36 default gates": (False, True, True, "apart", (1, 36)),
    "1.37 default gates": (False, True, True, "apart", (1, 37)),
}


class VersionedApi(MemoryApi):
    """MemoryApi that drops and validates ResourceSlice fields as one server version does."""

    def __init__(self, server: str) -> None:
        super().__init__([NODE])
        self.lists, self.taints, self.capacity, self.counters, version = SERVERS[server]
        self.version: JSON = {"major": str(version[0]), "minor": f"{version[1]}+",
                              "gitVersion": f"v{version[0]}.{version[1]}.4-provider.1"}
        self.events: list[JSON] = []
        self.refuse_all = ""  # a 422 message for every slice write

    def _keep(self, obj: JSON) -> JSON:
        obj = copy.deepcopy(obj)
        spec = obj["spec"]
        if self.counters == "none":
            spec.pop("sharedCounters", None)
        for d in spec.get("devices", []):
            if self.counters == "none":
                d.pop("consumesCounters", None)
            if not self.taints:
                d.pop("taints", None)
            if not self.capacity:
                d.pop("allowMultipleAllocations", None)
                for c in d.get("capacity", {}).values():
                    c.pop("requestPolicy", None)
            if not self.lists:
                for a in d.get("attributes", {}).values():
                    a.pop("strings", None)
        return obj

    def _validate(self, spec: JSON) -> None:
        if self.refuse_all:
            raise ApiException(422, "Invalid", json.dumps({"message": self.refuse_all}))
        sets = {s["name"] for s in spec.get("sharedCounters", [])}
        if self.counters == "apart" and sets and spec.get("devices"):
            raise ApiException(422, "Invalid", '{"message": "spec: only one of devices, sharedCounters"}')
        if self.counters == "together":
            for d in spec.get("devices", []):
                for c in d.get("consumesCounters", []):
                    if c["counterSet"] not in sets:
                        raise ApiException(422, "Invalid", '{"message": "must reference a counterSet '
                                           'defined in the ResourceSlice sharedCounters"}')

    async def request(self, _api: Any, method: str, path: str, body: Any = None, **kw: Any) -> JSON:
        query = kw.get("query") or {}
        if path == f"/api/v1/nodes/{NODE}":
            return self.nodes[0]
        if path == "/version":
            if not self.version:
                raise ApiException(403, "Forbidden", "{}")
            return self.version
        if path.startswith("/api/v1/namespaces/default/events"):
            self.events.append(body)
            return dict(body)
        if method in ("POST", "PUT", "PATCH") and body is not None and "spec" in body:
            self._validate(body["spec"])
            body = self._keep(body)
            if query.get("dryRun"):
                return body
        return await super().request(_api, method, path, body, **kw)


def _caps(server: str) -> ServerCapabilities:
    return ServerCapabilities(("v1",), *SERVERS[server])  # type: ignore[arg-type]


@pytest.mark.parametrize("server", list(SERVERS))
def test_the_probe_finds_what_each_server_keeps(monkeypatch: pytest.MonkeyPatch, server: str) -> None:
    api = VersionedApi(server)
    monkeypatch.setattr(kube, "request", api.request)
    found = asyncio.run(probe_server(None, DRIVER))  # type: ignore[arg-type]
    assert found == ServerCapabilities(("v1",), *SERVERS[server])  # type: ignore[arg-type]
    assert api.slices == {}, "a probe stores nothing"


def test_features_whose_fields_would_be_dropped_are_off_with_the_gate_to_turn_on() -> None:
    features, off = decide(ASKED, _caps("1.34 default gates"))
    assert not (features.memory_shares or features.dynamic_mig or features.taints)
    by_flag = {o.feature: o.reason for o in off}
    assert set(by_flag) == {"--memory-shares", "--dynamic-mig", "device health taints"}
    assert "DRAConsumableCapacity" in by_flag["--memory-shares"]
    assert "DRAPartitionableDevices" in by_flag["--memory-shares"]
    assert "DRAPartitionableDevices" in by_flag["--dynamic-mig"]

    features, off = decide(SliceFeatures(memory_shares=True, shares_only=True), _caps("1.35 default gates"))
    assert (features.memory_shares, features.shares_only, [o.feature for o in off]) == (
        False, False, ["--memory-shares-only", "device health taints"])

    features, off = decide(ASKED, _caps("1.36 default gates"))
    assert (features.memory_shares, features.dynamic_mig, off, features.counters_with_devices) == (
        True, True, (), False)
    features, off = decide(ASKED, _caps("1.34 DRA gates on"))
    assert (features.dynamic_mig, features.counters_with_devices) == (True, True)


@pytest.mark.parametrize("server", ["1.34 DRA gates on", "1.35 DRA gates on"])
def test_before_1_36_a_gpu_is_never_published_both_whole_and_as_a_share(server: str) -> None:
    """The 1.34 and 1.35 allocators gave GPUs out twice (issue 54): there, whole GPUs and share
    views are never published side by side; the share views alone (--memory-shares-only) still are."""
    features, off = decide(ASKED, _caps(server))
    assert not features.memory_shares
    assert features.dynamic_mig, "MIG placements keep their counters on both"
    (why,) = [o.reason for o in off if o.feature == "--memory-shares"]
    assert f"Kubernetes {server[:4]}" in why and "1.36" in why and "--memory-shares-only" in why
    features, off = decide(SliceFeatures(memory_shares=True, shares_only=True), _caps(server))
    assert (features.memory_shares, features.shares_only, off) == (True, True, ())


def test_a_server_that_does_not_say_its_version_is_judged_by_its_counter_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = VersionedApi("1.35 DRA gates on")
    api.version = {}
    monkeypatch.setattr(kube, "request", api.request)
    found = asyncio.run(probe_server(None, DRIVER))  # type: ignore[arg-type]
    assert found.version is None
    assert decide(ASKED, found)[0].memory_shares, "no version: the 1.35+ layout decides"
    assert not decide(ASKED, replace(found, counters="together"))[0].memory_shares


def test_on_1_34_each_counter_set_is_in_the_slice_of_its_consumers() -> None:
    inventory = discover("hgx-h200-mig")
    asked = SliceFeatures(dynamic_mig=True)  # memory shares are off on 1.34 (the test above)
    features, _ = decide(asked, _caps("1.34 DRA gates on"))
    specs = desired_slices(inventory, NODE, DRIVER, features)
    api = VersionedApi("1.34 DRA gates on")
    for spec in specs:
        assert spec.get("devices"), "no counter-only slice on 1.34"
        api._validate(spec)  # every consumer finds its set in its own slice
    assert sum(len(s.get("sharedCounters", [])) for s in specs) == sum(
        len(s.get("sharedCounters", [])) for s in desired_slices(inventory, NODE, DRIVER, decide(
            asked, _caps("1.36 default gates"))[0]))


def _run(api: VersionedApi, ctl: SliceController, quiet_for: float = 1.5) -> None:
    """Run the loop until it settles, then watch `quiet_for` seconds more for a write (a rewrite
    loop writes 2-4 times a second, so any would show); the caller's counts then say whether
    one came."""
    async def scenario() -> None:
        task = asyncio.create_task(watched(ctl).run())
        try:
            await settle(api, ctl)
            settled_writes = api.writes
            await watch_for_async(lambda: api.writes != settled_writes, quiet_for)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    asyncio.run(scenario())


@pytest.mark.parametrize("server", list(SERVERS))
def test_shares_and_dynamic_mig_asked_one_write_per_slice_and_one_warning(
    monkeypatch: pytest.MonkeyPatch, server: str
) -> None:
    api = VersionedApi(server)
    monkeypatch.setattr(kube, "request", api.request)
    monkeypatch.setattr(kube, "watch", api.watch)
    inventory = discover("hgx-h200-mig")
    with structlog.testing.capture_logs() as logs:
        ctl = asyncio.run(slice_controller(None, DRIVER, {NODE: inventory}, "auto",  # type: ignore[arg-type]
                                           memory_shares=True, dynamic_mig=True))
        _run(api, ctl)
    slices = len(ctl.pools[NODE].slice_specs)
    assert (ctl.stats.writes, api.writes, ctl.stats.refused, ctl.stats.adopted) == (slices, slices, 0, 0)
    stored = [s["spec"] for s in api.slices.values()]
    assert stored == list(ctl.pools[NODE].slice_specs) or sorted(map(str, stored)) == sorted(
        str({**s, "pool": stored[0]["pool"]}) for s in ctl.pools[NODE].slice_specs), "stored as published"
    carries = SERVERS[server][3] != "none"
    devices = [d for s in stored for d in s.get("devices", [])]
    # Never a device the scheduler could double-book: a share view or a MIG placement is
    # published only with the counters that keep it apart from the whole GPU.
    assert any("-mig-" in d["name"] and "consumesCounters" in d for d in devices) is carries
    assert all("consumesCounters" in d for d in devices if d["name"].endswith("-share") or (
        "-mig-" in d["name"] and "uuid" not in d.get("attributes", {})))
    warnings = [e for e in logs if e["log_level"] == "warning" and e.get("feature")]
    assert len(warnings) == len(ctl.features_off) == len(api.events)
    assert {w["feature"] for w in warnings} >= (set() if carries else {"--memory-shares", "--dynamic-mig"})
    for event, off in zip(api.events, ctl.features_off, strict=True):
        assert (event["type"], event["involvedObject"]["kind"], event["reason"]) == (
            "Warning", "Node", "DRAFeatureOff")
        assert event["message"].startswith(f"{off.feature} is off on this node: the ")
        assert event["message"].endswith(off.reason)
        assert metrics.features_off.labels(feature=off.feature)._value.get() == 1


def test_a_server_that_drops_fields_the_probe_missed_is_not_rewritten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gate the probe did not catch: the slice is replaced once, then kept as stored."""
    api = VersionedApi("1.34 default gates")
    monkeypatch.setattr(kube, "request", api.request)
    monkeypatch.setattr(kube, "watch", api.watch)
    features = SliceFeatures(memory_shares=True)  # as if the probe had said yes
    ctl = SliceController(api=None, driver=DRIVER,  # type: ignore[arg-type]
                          pools=pools_for({NODE: discover("hgx-h200")}, DRIVER, features), features=features)
    with structlog.testing.capture_logs() as logs:
        _run(api, ctl)
    assert (ctl.stats.creates, ctl.stats.updates, ctl.stats.adopted) == (2, 2, 2)  # devices + counters
    dropped = [e for e in logs if e["event"].startswith("the API server drops fields")]
    assert len(dropped) == 2 and any("consumesCounters" in p for p in dropped[0]["dropped"])


def test_a_refused_write_is_logged_whole_once_and_not_retried_in_a_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = VersionedApi("1.37 default gates")
    api.refuse_all = "spec.devices[0].consumesCounters[0].counterSet: Invalid value: " + "x" * 600
    monkeypatch.setattr(kube, "request", api.request)
    monkeypatch.setattr(kube, "watch", api.watch)
    ctl = SliceController(api=None, driver=DRIVER,  # type: ignore[arg-type]
                          pools=pools_for({NODE: discover("hgx-h200")}, DRIVER, SliceFeatures()))
    writes: list[int] = []

    async def scenario() -> None:
        task = asyncio.create_task(watched(ctl).run())
        try:
            await settle(api, ctl)
            # A window in which no second attempt may come (a retry loop would write 4 times in it).
            await watch_for_async(lambda: ctl.stats.creates > 1, 2.0)
            writes.append(ctl.stats.creates)
            # Its desired slices change (a health taint, say): written again at once.
            api.refuse_all = ""
            first = ctl.pools[NODE].slice_specs[0]
            changed = {**first, "devices": first["devices"][:-1]}
            ctl.pools[NODE] = replace(ctl.pools[NODE], slice_specs=(changed,))
            ctl._mark(NODE)
            await settle(api, ctl)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    with structlog.testing.capture_logs() as logs:
        asyncio.run(scenario())
    assert writes == [1], "one attempt, not retried"
    assert ctl.stats.refused == 1 and api.writes == 1
    errors = [e for e in logs if e["log_level"] == "error"]
    assert len(errors) == 1
    assert errors[0]["error"].endswith("x" * 600), "the whole message, once"


def test_the_capabilities_of_a_full_server_change_nothing() -> None:
    features, off = decide(ASKED, ServerCapabilities.everything())
    assert (features, off) == (ASKED, ())
    assert reconciler.RETRY_REFUSED_SECONDS >= 60


@pytest.mark.parametrize(("stored", "said"), [
    ({"spec": {"extendedResourceName": "example.com/gpu"}}, False),
    ({"spec": {}}, True),  # the server without DRAExtendedResource drops it
    ({"spec": {"extendedResourceName": "nvidia.com/gpu"}}, True),  # another release's class
    (None, False),  # no class to read: says nothing about the gate
])
def test_an_extended_resource_class_stored_without_its_name_is_said(
    monkeypatch: pytest.MonkeyPatch, stored: JSON | None, said: bool
) -> None:
    async def request(_api: Any, method: str, path: str, *args: Any, **kw: Any) -> JSON:
        assert (method, path) == ("GET", f"/apis/resource.k8s.io/v1/deviceclasses/extended.{DRIVER}")
        if stored is None:
            raise ApiException(404, "NotFound", "{}")
        return stored

    monkeypatch.setattr(kube, "request", request)
    off = asyncio.run(extended_resource_dropped(None, DRIVER, "example.com/gpu"))  # type: ignore[arg-type]
    assert (off is not None) is said
    if off:
        assert off.feature == "extendedResource" and "DRAExtendedResource" in off.reason
        assert "extendedResource.enabled=false" in off.reason
