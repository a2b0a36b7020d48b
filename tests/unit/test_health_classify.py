"""The health classifier: event -> severity, with overrides, recovery action and the XID table."""

from __future__ import annotations

import pytest

from dra_driver.health.classify import (
    XID_TABLE,
    HealthPolicy,
    Severity,
    classify,
    classify_probe,
    parse_xid_severities,
)
from dra_driver.health.events import EventKind, HealthEvent, Probe

POLICY = HealthPolicy()


def xid(number: int, action: int | None = None) -> HealthEvent:
    return HealthEvent(gpu=0, kind=EventKind.XID, data=number, recovery_action=action)


@pytest.mark.parametrize(
    ("number", "severity"),
    [(13, Severity.INFO), (31, Severity.INFO), (43, Severity.INFO), (74, Severity.NO_SCHEDULE),
     (94, Severity.NO_SCHEDULE), (48, Severity.NO_EXECUTE), (79, Severity.NO_EXECUTE),
     (95, Severity.NO_EXECUTE)],
)
def test_the_xid_table_decides_without_a_recovery_action(number: int, severity: Severity) -> None:
    verdict = classify(xid(number), POLICY)
    assert (verdict.severity, verdict.category, verdict.reason, verdict.source) == (
        severity, "xid", str(number), "xid-table"
    )


def test_an_unknown_xid_keeps_new_pods_off_the_gpu() -> None:
    assert 999 not in XID_TABLE
    verdict = classify(xid(999), POLICY)
    assert (verdict.severity, verdict.source) == (Severity.NO_SCHEDULE, "default")


@pytest.mark.parametrize(
    ("action", "severity"),
    [(0, Severity.INFO), (1, Severity.NO_EXECUTE), (2, Severity.NO_EXECUTE), (3, Severity.NO_SCHEDULE),
     (4, Severity.NO_SCHEDULE), (5, Severity.INFO), (42, Severity.NO_SCHEDULE)],
)
def test_nvmls_recovery_action_wins_over_the_table(action: int, severity: Severity) -> None:
    verdict = classify(xid(79, action), POLICY)  # 79 is NoExecute in the table
    assert (verdict.severity, verdict.source) == (severity, "recovery-action")
    assert "recovery action" in verdict.message


def test_an_override_wins_over_everything() -> None:
    policy = HealthPolicy(xid_overrides={79: Severity.INFO, 13: Severity.NO_EXECUTE})
    assert classify(xid(79, 1), policy).severity is Severity.INFO
    assert classify(xid(13), policy).severity is Severity.NO_EXECUTE
    assert classify(xid(13), policy).source == "config"


@pytest.mark.parametrize(
    ("kind", "category", "severity"),
    [(EventKind.DOUBLE_BIT_ECC, "ecc", Severity.NO_EXECUTE), (EventKind.SINGLE_BIT_ECC, "ecc", Severity.INFO),
     (EventKind.FATAL_POISON, "poison", Severity.NO_EXECUTE),
     (EventKind.GPU_LOST, "gpu-lost", Severity.NO_EXECUTE),
     (EventKind.DRAM_RETIREMENT_FAILURE, "memory", Severity.NO_SCHEDULE)],
)
def test_other_event_types_have_fixed_severities(kind: EventKind, category: str, severity: Severity) -> None:
    verdict = classify(HealthEvent(gpu=1, kind=kind), POLICY)
    assert (verdict.category, verdict.severity, verdict.reason) == (category, severity, str(kind))


def test_a_recovery_action_event_is_named_by_its_action() -> None:
    verdict = classify(HealthEvent(gpu=0, kind=EventKind.RECOVERY_ACTION, data=2), POLICY)
    assert (verdict.category, verdict.reason, verdict.severity) == ("recovery-action", "node-reboot",
                                                                    Severity.NO_EXECUTE)


def test_probe_verdicts() -> None:
    assert classify_probe(Probe(0, lost=False, recovery_action=None)) is None
    assert classify_probe(Probe(0, lost=False, recovery_action=0)) is None
    assert classify_probe(Probe(0, lost=False, recovery_action=5)) is None  # IMEX domain: not this GPU's
    lost = classify_probe(Probe(0, lost=True, recovery_action=None))
    assert lost is not None and (lost.category, lost.severity) == ("gpu-lost", Severity.NO_EXECUTE)
    reset = classify_probe(Probe(0, lost=False, recovery_action=1))
    assert reset is not None and (reset.category, reset.reason) == ("recovery-action", "gpu-reset")


def test_the_effect_is_capped_by_the_policy() -> None:
    assert HealthPolicy().effect(Severity.NO_EXECUTE) == "NoSchedule"
    assert HealthPolicy(max_effect="NoExecute").effect(Severity.NO_EXECUTE) == "NoExecute"
    assert HealthPolicy(max_effect="NoExecute").effect(Severity.NO_SCHEDULE) == "NoSchedule"
    assert HealthPolicy(max_effect="NoExecute").effect(Severity.INFO) is None


def test_overrides_parse_and_bad_ones_say_what_to_write() -> None:
    assert parse_xid_severities("") == {}
    assert parse_xid_severities(" 13=NoSchedule, 94=none,79=NoExecute ") == {
        13: Severity.NO_SCHEDULE, 94: Severity.INFO, 79: Severity.NO_EXECUTE
    }
    for bad in ("13", "13=Evict", "x=None", "13=NoSchedule;14=None"):
        with pytest.raises(ValueError, match="write XID=SEVERITY"):
            parse_xid_severities(bad)
