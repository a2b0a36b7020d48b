"""The recovery state machine: conditions come with critical events, go after a clean quiet period."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.health.classify import HealthPolicy, Severity, Verdict, classify, classify_probe
from dra_driver.health.effects import device_view
from dra_driver.health.events import EventKind, HealthEvent, Probe
from dra_driver.health.state import HISTORY_LENGTH, DeviceState, on_event, on_probe, settle

POLICY = HealthPolicy(quiet_period=60.0)


def event(state: DeviceState, e: HealthEvent, now: float) -> DeviceState:
    return on_event(state, e, classify(e, POLICY), now)


def probe(state: DeviceState, now: float, lost: bool = False, action: int | None = None) -> DeviceState:
    return on_probe(state, classify_probe(Probe(0, lost, action, now)), now)


XID79 = HealthEvent(gpu=0, kind=EventKind.XID, data=79)
XID13 = HealthEvent(gpu=0, kind=EventKind.XID, data=13)
XID74 = HealthEvent(gpu=0, kind=EventKind.XID, data=74)


def test_informational_events_count_but_do_not_taint() -> None:
    state = event(DeviceState(), XID13, 10.0)
    state = event(state, HealthEvent(gpu=0, kind=EventKind.XID, data=13, count=500), 11.0)
    assert not state.conditions
    assert state.counts == {"xid-13": 501}
    assert [r.count for r in state.recent] == [1, 500]
    assert device_view(state, DRIVER, POLICY).healthy


def test_a_fatal_xid_taints_until_a_clean_check_and_the_quiet_period() -> None:
    state = event(DeviceState(), XID79, 100.0)
    view = device_view(state, DRIVER, POLICY)
    assert not view.healthy and "XID 79" in view.message
    assert [(t.key, t.value, t.effect, t.time_added) for t in view.taints] == [
        (f"{DRIVER}/xid", "79", "NoSchedule", 100)
    ]
    assert settle(state, 10_000.0, 60.0) is state, "no clean check yet: stays tainted however long"
    state = probe(state, 105.0)
    assert state.clear_since == 105.0
    assert settle(state, 164.0, 60.0).conditions, "quiet period not over"
    healed = settle(state, 165.0, 60.0)
    assert not healed.conditions and healed.recoveries == 1
    assert healed.recent[-1].what == "recovered"
    assert device_view(healed, DRIVER, POLICY).taints == ()


def test_a_new_critical_event_restarts_the_quiet_period() -> None:
    state = probe(event(DeviceState(), XID79, 100.0), 105.0)
    state = event(state, XID79, 150.0)
    assert state.clear_since is None
    state = probe(state, 155.0)
    assert settle(state, 209.0, 60.0).conditions
    assert not settle(state, 215.0, 60.0).conditions


def test_a_storm_of_the_same_or_weaker_events_never_changes_the_taint() -> None:
    state = event(DeviceState(), XID79, 100.0)
    first = device_view(state, DRIVER, POLICY)
    for i in range(1000):
        state = event(state, XID79 if i % 2 else XID74, 100.0 + i)
    state = event(state, XID13, 2000.0)
    assert device_view(state, DRIVER, POLICY) == first
    assert state.counts == {"xid-79": 501, "xid-74": 500, "xid-13": 1}
    assert len(state.recent) == HISTORY_LENGTH


def test_a_stronger_event_upgrades_the_category() -> None:
    state = event(DeviceState(), XID74, 100.0)
    assert device_view(state, DRIVER, POLICY).taints[0].value == "74"
    policy = HealthPolicy(max_effect="NoExecute")
    state = event(state, XID79, 120.0)
    taint = device_view(state, DRIVER, policy).taints[0]
    assert (taint.value, taint.effect, taint.time_added) == ("79", "NoExecute", 120)


def test_several_categories_give_several_taints_and_the_strongest_message() -> None:
    state = event(DeviceState(), XID74, 100.0)
    state = event(state, HealthEvent(gpu=0, kind=EventKind.DOUBLE_BIT_ECC), 101.0)
    view = device_view(state, DRIVER, HealthPolicy(max_effect="NoExecute"))
    assert [(t.key, t.effect) for t in view.taints] == [(f"{DRIVER}/ecc", "NoExecute"),
                                                       (f"{DRIVER}/xid", "NoSchedule")]
    assert "double-bit-ecc" in view.message


def test_a_lost_gpu_stays_tainted_until_it_answers_again() -> None:
    state = probe(DeviceState(), 10.0, lost=True)
    assert [c.category for c in state.conditions.values()] == ["gpu-lost"]
    for t in range(15, 500, 5):
        state = probe(state, float(t), lost=True)
        state = settle(state, float(t), 60.0)
    assert state.conditions and state.conditions["gpu-lost"].since == 10.0
    state = probe(state, 500.0)
    assert not settle(state, 560.0, 60.0).conditions


def test_a_pending_recovery_action_blocks_recovery_without_adding_a_second_taint() -> None:
    state = event(DeviceState(), HealthEvent(gpu=0, kind=EventKind.XID, data=79, recovery_action=1), 100.0)
    for t in range(105, 1000, 5):
        state = settle(probe(state, float(t), action=1), float(t), 60.0)
    assert list(state.conditions) == ["xid"]
    state = probe(state, 1000.0, action=0)
    assert not settle(state, 1060.0, 60.0).conditions


def test_a_recovery_action_without_an_event_taints_by_itself() -> None:
    state = probe(DeviceState(), 10.0, action=4)  # drain and reset, no XID seen (NVIDIA #982)
    view = device_view(state, DRIVER, POLICY)
    assert [(t.key, t.value) for t in view.taints] == [(f"{DRIVER}/recovery-action", "drain-and-reset")]


def test_a_healthy_device_ignores_clean_checks() -> None:
    assert probe(DeviceState(), 10.0) == DeviceState()


VERDICTS = st.sampled_from(
    [Verdict(s, c, r, "m", "test") for s in Severity for c, r in (("xid", "79"), ("ecc", "dbe"))]
)


@given(st.lists(st.tuples(st.booleans(), VERDICTS, st.floats(0, 5)), max_size=40))
def test_a_device_always_recovers_after_clean_checks_and_the_quiet_period(
    steps: list[tuple[bool, Verdict, float]],
) -> None:
    now, state = 0.0, DeviceState()
    for is_event, verdict, dt in steps:
        now += dt
        if is_event:
            state = on_event(state, HealthEvent(gpu=0, kind=EventKind.XID, data=79), verdict, now)
        else:
            state = on_probe(state, verdict if verdict.severity else None, now)
        state = settle(state, now, 60.0)
        if state.conditions:
            assert all(c.severity > Severity.INFO for c in state.conditions.values())
    state = on_probe(state, None, now + 1)
    assert not settle(state, now + 62, 60.0).conditions


def test_the_xid_that_explains_a_probed_recovery_action_replaces_its_condition() -> None:
    """Behind a storm the periodic check may see a fatal XID's recovery action before the XID
    is read: the device is tainted at once, and the XID's condition then takes the place of
    the check's, so one taint names the cause."""
    state = probe(DeviceState(), 10.0, action=1)
    assert [(t.key, t.value) for t in device_view(state, DRIVER, POLICY).taints] == [
        (f"{DRIVER}/recovery-action", "gpu-reset")
    ]
    state = event(state, HealthEvent(gpu=0, kind=EventKind.XID, data=79, recovery_action=1), 10.4)
    assert [(t.key, t.value) for t in device_view(state, DRIVER, POLICY).taints] == [(f"{DRIVER}/xid", "79")]
    assert probe(state, 11.0, action=1).conditions.keys() == {"xid"}, "the next check adds nothing"
    weaker = event(probe(DeviceState(), 10.0, action=1), XID74, 10.4)  # NoSchedule: explains less
    assert weaker.conditions.keys() == {"recovery-action", "xid"}
