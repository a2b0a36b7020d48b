"""The NVML health monitor on simulated GPUs: injected events come out of the same event-wait
code path as real NVML's, are coalesced in storms, and reach the keeper; lost GPUs are found
at once; what a GPU does not offer is said once; the thread stops cleanly."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import queue
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
from structlog.testing import capture_logs

from dra_driver.devices import node_devices
from dra_driver.gpu import choose_backend, discover, load_profile
from dra_driver.gpu.sim.events import WANTED_BY_NAME, BadInjection, FakeEventSource
from dra_driver.gpu.sim.fake_nvml import FakeNvml
from dra_driver.health.classify import HealthPolicy
from dra_driver.health.effects import affected_devices
from dra_driver.health.events import EventKind, HealthEvent, Probe
from dra_driver.health.monitor import Batch, NvmlHealthMonitor
from dra_driver.health.node import gpu_refs, start_node_health
from tests.harness.objects import wait_for, wait_for_async, watch_for_async

PROFILE = "hgx-h200"


class Collector:
    def __init__(self) -> None:
        self.batches: queue.Queue[Batch] = queue.Queue()

    def __call__(self, batch: Batch) -> None:
        self.batches.put(batch)

    def until(self, what: str, check: object, timeout: float = 30.0) -> list[HealthEvent | Probe]:
        """Items collected until `check(items)` holds."""
        items: list[HealthEvent | Probe] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                items.extend(self.batches.get(timeout=0.05))
            if check(items):  # type: ignore[operator]
                return items
        raise AssertionError(f"no {what} within {timeout} s: {items[-10:]}")


@pytest.fixture
def fake() -> FakeNvml:
    profile = load_profile(PROFILE)
    return FakeNvml(profile, FakeEventSource(len(profile.gpus)))


@pytest.fixture
def started(fake: FakeNvml) -> Iterator[tuple[NvmlHealthMonitor, Collector, FakeNvml]]:
    collector = Collector()
    monitor = NvmlHealthMonitor(fake, gpu_refs(discover(PROFILE)), collector, probe_interval=30.0)
    monitor.start()
    yield monitor, collector, fake
    monitor.stop()


def events(items: list[HealthEvent | Probe]) -> list[HealthEvent]:
    return [i for i in items if isinstance(i, HealthEvent)]


def test_an_injected_xid_comes_out_of_the_event_wait_with_the_recovery_action(
    started: tuple[NvmlHealthMonitor, Collector, FakeNvml],
) -> None:
    monitor, collector, fake = started
    assert fake.events is not None
    fake.events.inject({"gpu": 3, "xid": 79, "recovery_action": 1})
    items = collector.until("the XID", lambda got: events(got))
    (event,) = events(items)
    assert (event.gpu, event.kind, event.data, event.recovery_action) == (3, EventKind.XID, 79, 1)
    assert event.count == 1
    assert event.gpu_instance is None
    assert monitor.delivered_events == 1


Started = tuple[NvmlHealthMonitor, Collector, FakeNvml]


def test_a_storm_is_coalesced_into_a_few_batches(started: Started) -> None:
    _, collector, fake = started
    assert fake.events is not None
    fake.events.inject({"gpu": 0, "xid": 13, "repeat": 5000})
    fake.events.inject({"gpu": 0, "event": "single-bit-ecc", "repeat": 3000})
    batches: list[int] = []

    def done(got: list[HealthEvent | Probe]) -> bool:
        return sum(e.count for e in events(got)) >= 8000

    deadline = time.monotonic() + 20
    got: list[HealthEvent | Probe] = []
    while not done(got) and time.monotonic() < deadline:
        try:
            batch = collector.batches.get(timeout=0.1)
        except queue.Empty:
            continue
        batches.append(len(batch))
        got.extend(batch)
    counted = {(e.kind, e.data): 0 for e in events(got)}
    for e in events(got):
        counted[(e.kind, e.data)] += e.count
    assert counted == {(EventKind.XID, 13): 5000, (EventKind.SINGLE_BIT_ECC, 0): 3000}
    assert sum(batches) < 200, f"{len(batches)} batches holding {sum(batches)} items for 8000 events"


def test_an_event_costs_no_nvml_call_but_the_wait(started: Started) -> None:
    """A storm is only as harmless as the monitor is fast: NVML hands events over one at a
    time, so a fatal XID behind 20,000 informational ones waits for each of them to be read.
    No UUID lookup per event: the GPU comes from the handle, mapped at registration."""
    monitor, collector, fake = started
    assert fake.events is not None
    fake.calls.clear()
    fake.events.inject({"gpu": 0, "xid": 13, "repeat": 20_000})
    fake.events.inject({"gpu": 3, "xid": 79, "recovery_action": 1})
    items = collector.until("the fatal XID behind the storm", lambda got: any(
        e.data == 79 for e in events(got)))
    assert monitor.delivered_events == 20_001, "every event read, in order"
    assert sum(e.count for e in events(items) if e.data == 13) == 20_000
    per_event = [name for name, _ in fake.calls if name != "nvmlDeviceGetFieldValues"]
    assert per_event == [], f"NVML calls beside the wait during the storm: {per_event[:5]}"


def test_a_fatal_xid_behind_a_backlog_taints_from_the_periodic_check(tmp_path: Path) -> None:
    """More informational events than the monitor can read: the fatal XID waits behind them in
    NVML's queue, but its recovery action does not, and the check (every second) taints the
    GPU long before the XID itself is read."""
    inventory = discover(PROFILE)
    backlog = 2_000_000

    async def scenario() -> tuple[int, list[str]]:
        nvml = choose_backend(PROFILE).nvml
        assert isinstance(nvml, FakeNvml) and nvml.events is not None
        health = await start_node_health(inventory, node_devices(inventory), "gpu.dra-driver.dev",
                                         HealthPolicy(), nvml)
        try:
            nvml.events.inject({"gpu": 0, "xid": 13, "repeat": backlog})
            nvml.events.inject({"gpu": 5, "xid": 79, "recovery_action": 1})
            await wait_for_async("gpu-5 tainted", lambda: not health.keeper.views["gpu-5"].healthy,
                                 timeout=60, detail=lambda: health.monitor.delivered_events)
            read = health.monitor.delivered_events
            return read, [f"{t.key}={t.value}" for t in health.keeper.views["gpu-5"].taints]
        finally:
            await health.stop()

    read, taints = asyncio.run(scenario())
    assert read < backlog, f"tainted only after the whole backlog was read ({read} events)"
    assert taints == ["gpu.dra-driver.dev/recovery-action=gpu-reset"]


def test_events_of_a_handle_not_registered_are_attributed_by_uuid_once() -> None:
    """A handle the monitor did not see at registration (as a MIG device's may be) is named
    once through nvmlDeviceGetUUID, then remembered."""
    profile = load_profile(PROFILE)
    source = FakeEventSource(len(profile.gpus))
    fake = FakeNvml(profile, source)
    collector = Collector()
    monitor = NvmlHealthMonitor(fake, gpu_refs(discover(PROFILE)), collector, probe_interval=30.0)
    monitor.start()
    try:
        monitor._gpu_of_handle.clear()  # as if NVML returned handles it never gave at registration
        fake.calls.clear()
        source.inject({"gpu": 2, "xid": 13, "repeat": 50})
        items = collector.until("the events", lambda got: sum(e.count for e in events(got)) >= 50)
        assert {e.gpu for e in events(items)} == {2}
        assert [n for n, _ in fake.calls].count("nvmlDeviceGetUUID") == 1
    finally:
        monitor.stop()


def test_a_lost_gpu_is_found_at_once_not_at_the_next_periodic_check(
    started: tuple[NvmlHealthMonitor, Collector, FakeNvml],
) -> None:
    _, collector, fake = started
    assert fake.events is not None
    fake.events.inject({"gpu": 5, "lost": True})
    start = time.monotonic()
    items = collector.until("a lost probe", lambda got: any(isinstance(i, Probe) and i.lost for i in got))
    assert time.monotonic() - start < 15, "the periodic check is 30 s away: GPU_IS_LOST must trigger it"
    lost = [i.gpu for i in items if isinstance(i, Probe) and i.lost]
    assert lost == [5]
    fake.events.inject({"gpu": 5, "recover": True})
    assert not fake.events.is_lost(5)


def test_what_a_gpu_does_not_offer_is_said_once_and_the_rest_is_watched() -> None:
    profile = load_profile("h200-single")
    xid_only = WANTED_BY_NAME["xid"]
    fake = FakeNvml(profile, FakeEventSource(1), supported_events=xid_only, recovery_action_field=False)
    collector = Collector()
    monitor = NvmlHealthMonitor(fake, gpu_refs(discover("h200-single")), collector, probe_interval=0.2)
    with capture_logs() as logs:
        facts = monitor.start()
        collector.until("the first periodic check", lambda got: any(isinstance(i, Probe) for i in got))
        # well checks are handed over once; the checks themselves go on
        wait_for("several periodic checks",
                 lambda: [n for n, _ in fake.calls].count("nvmlDeviceGetMemoryInfo") >= 3)
        assert fake.events is not None
        fake.events.inject({"gpu": 0, "event": "double-bit-ecc"})  # not registered: never delivered
        fake.events.inject({"gpu": 0, "xid": 48})
        items = collector.until("the XID", lambda got: events(got))
        monitor.stop()
    assert facts.registered == {0: ("xid",)}
    assert "double-bit-ecc" in facts.unsupported[0] and "xid" not in facts.unsupported[0]
    assert facts.recovery_action_field == {0: False}
    said = [entry for entry in logs if entry["event"] == "health monitor watching GPU"]
    assert len(said) == 1 and "double-bit-ecc" in said[0]["not_offered"]
    assert [(e.kind, e.data, e.recovery_action) for e in events(items)] == [(EventKind.XID, 48, None)]
    assert not [e for e in logs if e["log_level"] in ("warning", "error")], logs


def test_register_falls_back_to_one_type_at_a_time(fake: FakeNvml) -> None:
    calls = 0
    register = fake.nvmlDeviceRegisterEvents

    def picky(handle: object, event_types: int, event_set: object) -> None:
        nonlocal calls
        calls += 1
        if event_types & (event_types - 1):  # more than one bit: this driver refuses
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        register(handle, event_types, event_set)

    fake.nvmlDeviceRegisterEvents = picky  # type: ignore[method-assign]
    monitor = NvmlHealthMonitor(fake, gpu_refs(discover(PROFILE))[:1], Collector())
    facts = monitor.start()
    monitor.stop()
    assert set(facts.registered[0]) == {str(k) for k in EventKind if k is not EventKind.GPU_LOST}


def test_the_thread_stops_and_releases_nvml(started: tuple[NvmlHealthMonitor, Collector, FakeNvml]) -> None:
    monitor, _, fake = started
    start = time.monotonic()
    monitor.stop()
    assert time.monotonic() - start < 3
    names = [name for name, _ in fake.calls]
    assert names[-2:] == ["nvmlEventSetFree", "nvmlShutdown"]
    assert names.count("nvmlInit") == names.count("nvmlShutdown") == 1


def test_a_changed_gpu_set_is_refused(fake: FakeNvml) -> None:
    refs = gpu_refs(discover(PROFILE))
    wrong = [type(refs[0])(refs[0].index, "GPU-not-this-one")]
    with pytest.raises(Exception, match="restart the plugin"):
        NvmlHealthMonitor(fake, wrong, Collector()).start()
    assert [name for name, _ in fake.calls][-1] == "nvmlShutdown"


def test_mig_scoped_events_concern_that_mig_device_only() -> None:
    devices = node_devices(discover("a100-mig"))
    assert affected_devices(devices, 5, 2, 0) == ("gpu-5-mig-3g20gb-4",)
    assert affected_devices(devices, 5) == ("gpu-5-mig-3g20gb-0", "gpu-5-mig-3g20gb-4")
    assert affected_devices(devices, 5, 0xFFFFFFFF, 0xFFFFFFFF) == affected_devices(devices, 5)
    assert affected_devices(devices, 5, 77) == affected_devices(devices, 5), "unknown instance: the whole GPU"
    assert affected_devices(devices, 1) == ("gpu-1",)


def test_the_control_file_is_followed_and_bad_lines_say_what_to_fix(tmp_path: Path) -> None:
    control = tmp_path / "events.jsonl"
    control.write_text(json.dumps({"gpu": 2, "lost": True}) + "\n" + json.dumps({"gpu": 1, "xid": 79}) + "\n")
    control.chmod(0o600)  # only a file no one else can write is followed
    source = FakeEventSource(4, control)
    assert source.is_lost(2) and not source.pending(), "lines present at start set state, replay no event"
    with control.open("a") as f:
        f.write('{"gpu": 9, "xid": 79}\nnot json\n{"gpu": 0, "xid": 79, "colour": "red"}\n')
        f.write(json.dumps({"gpu": 1, "xid": 48, "recovery_action": 2}) + "\n" + '{"gpu": 3, "xi')
    with capture_logs() as logs:
        source.poll()
    problems = [e["problem"] for e in logs if e["event"] == "simulated health event skipped"]
    assert len(problems) == 3
    assert "GPU index from 0 to 3" in problems[0] and "unknown keys ['colour']" in problems[2]
    assert source.action(1) == 2
    xid = WANTED_BY_NAME["xid"]
    assert source.next_event({1: xid}, time.monotonic())[:3] == (1, xid, 48)  # type: ignore[index]
    with control.open("a") as f:
        f.write('d": 43}\n')  # the rest of the half-written line
    source.poll()
    assert source.next_event({3: xid}, time.monotonic())[:3] == (3, xid, 43)  # type: ignore[index]
    with pytest.raises(BadInjection, match="'event' must be one of"):
        source.inject({"gpu": 0, "event": "meltdown"})


def test_the_keeper_taints_and_recovers_a_gpu_through_the_control_file(tmp_path: Path) -> None:
    control = tmp_path / "events.jsonl"
    inventory = discover(PROFILE)
    devices = node_devices(inventory)

    async def scenario() -> tuple[float, float, dict[str, int]]:
        health = await start_node_health(
            inventory, devices, "gpu.dra-driver.dev", HealthPolicy(quiet_period=0.5),
            choose_backend(PROFILE, events_file=control).nvml, probe_interval=0.2,
        )
        settle = asyncio.create_task(health.keeper.settle_forever(0.1))
        try:
            start = time.monotonic()
            with control.open("a") as f:
                f.write(json.dumps({"gpu": 6, "xid": 79, "recovery_action": 1}) + "\n")
            await wait_for_async("the taint", lambda: not health.keeper.views["gpu-6"].healthy,
                                 detail=lambda: health.keeper.views["gpu-6"])
            tainted = time.monotonic() - start
            checked = health.keeper.history_version
            view = health.keeper.views["gpu-6"]
            taints = [(t.key, t.value, t.effect) for t in view.taints]
            assert taints == [("gpu.dra-driver.dev/xid", "79", "NoSchedule")]

            def checks() -> int:  # batches the keeper applied since the taint
                return health.keeper.history_version - checked

            # A window of three quiet periods with the action pending, in which the taint must
            # stay, and then the periodic checks (every 0.2 s) that say it is pending taken in.
            untainted = await watch_for_async(lambda: health.keeper.views["gpu-6"].healthy, 1.5)
            assert not untainted, "recovery action pending: must stay tainted"
            await wait_for_async("three periodic checks", lambda: checks() >= 3, detail=checks)
            assert not health.keeper.views["gpu-6"].healthy, "recovery action pending: must stay tainted"
            start = time.monotonic()
            with control.open("a") as f:
                f.write(json.dumps({"gpu": 6, "recover": True}) + "\n")
            await wait_for_async("the recovery", lambda: health.keeper.views["gpu-6"].healthy,
                                 detail=lambda: health.keeper.views["gpu-6"])
            recovered = time.monotonic() - start
            assert all(v.healthy for v in health.keeper.views.values())
            return tainted, recovered, dict(health.keeper.states["gpu-6"].counts)
        finally:
            settle.cancel()
            await health.stop()

    tainted, recovered, counts = asyncio.run(scenario())
    # bounds far from the figures (well under 1 s here) so that a loaded machine passes; the
    # lower one is the point: recovery waits out the quiet period
    assert tainted < 5.0
    assert 0.5 <= recovered < 10.0
    assert counts == {"xid-79": 1}


def test_each_wait_is_counted_by_how_it_ended(fake: FakeNvml) -> None:
    """The gpu_dra_health_monitor_waits counter's source: timeouts while quiet, one count per
    event taken, ignored for an event of a kind not asked for, lost for a GPU that fell off."""
    ended: collections.Counter[str] = collections.Counter()
    collector = Collector()
    monitor = NvmlHealthMonitor(fake, gpu_refs(discover(PROFILE)), collector, wait_ms=50, probe_interval=30.0,
                                count_wait=lambda result: ended.update([result]))
    monitor.start()
    try:
        wait_for("a quiet wait to time out", lambda: ended["timeout"] >= 1, detail=lambda: ended)
        assert fake.events is not None
        fake.events.inject({"gpu": 3, "xid": 13, "repeat": 5})
        collector.until("the events", lambda got: sum(e.count for e in events(got)) >= 5)
        assert ended["event"] == 5
        fake.events.inject({"gpu": 3, "lost": True})
        wait_for("the lost GPU's wait", lambda: ended["lost"] >= 1, detail=lambda: ended)
        assert ended["ignored"] == 0 and ended["error"] == 0
    finally:
        monitor.stop()


def test_a_quiet_monitor_waits_once_per_check_and_never_spins(fake: FakeNvml) -> None:
    """The wait before a check is due is rounded up to whole milliseconds: rounded down, the
    wait ended just before the check and every remainder below 1 ms became a wait of 0, a few
    hundred turns a second on a quiet node (issue 50's idle CPU)."""
    ended: collections.Counter[str] = collections.Counter()
    monitor = NvmlHealthMonitor(fake, gpu_refs(discover(PROFILE)), Collector(), probe_interval=0.1,
                                count_wait=lambda result: ended.update([result]))
    monitor.start()
    try:
        start = time.monotonic()
        wait_for("ten checks' waits", lambda: ended["timeout"] >= 10, detail=lambda: ended)
        elapsed = time.monotonic() - start
    finally:
        monitor.stop()
    # one wait per 0.1 s check, and one more now and then: a spin makes hundreds
    assert ended["timeout"] <= 2 * elapsed / 0.1 + 5, (ended, elapsed)


def test_well_checks_go_out_once_after_events_and_every_check_that_finds_something(fake: FakeNvml) -> None:
    """A check that finds every GPU well changes nothing in the keeper once it has had that
    news since the last events; it is not handed over again. One after events is (it starts
    a condition's quiet period), and every check that finds a lost GPU is."""
    collector = Collector()
    monitor = NvmlHealthMonitor(fake, gpu_refs(discover(PROFILE)), collector, probe_interval=0.05)
    monitor.start()
    try:
        collector.until("the first checks", lambda got: any(isinstance(i, Probe) for i in got))
        wait_for("more checks", lambda: [n for n, _ in fake.calls].count("nvmlDeviceGetMemoryInfo") >= 40)
        assert collector.batches.empty(), "well checks went out again with nothing new"
        assert fake.events is not None
        fake.events.inject({"gpu": 1, "xid": 13})
        after = collector.until("the event, then checks", lambda got: any(isinstance(i, Probe) for i in got))
        assert events(after) and all(not p.lost for p in after if isinstance(p, Probe))
        fake.events.inject({"gpu": 4, "lost": True})
        lost = collector.until("two checks of the lost GPU",
                               lambda got: sum(isinstance(i, Probe) and i.lost for i in got) >= 2)
        assert {p.gpu for p in lost if isinstance(p, Probe) and p.lost} == {4}
    finally:
        monitor.stop()
