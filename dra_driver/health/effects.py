"""What a device's health state means to the outside: its taints, its health-stream status,
and which published devices an event on a GPU concerns.

A condition becomes one taint `<driver>/<category>=<reason>:<effect>` with `timeAdded`
the time the condition began (so the slice stays byte-identical while the condition
lasts: no rewrite per event). The health stream says Unhealthy with the strongest
condition's message while any condition lasts, Healthy otherwise.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from dra_driver.devices import NodeDevice
from dra_driver.health.classify import HealthPolicy, TaintEffect
from dra_driver.health.events import WHOLE_GPU
from dra_driver.health.state import DeviceState

_NOT_LABEL = re.compile(r"[^A-Za-z0-9_.-]")
MAX_LABEL_VALUE = 63


@dataclass(frozen=True)
class DeviceTaint:
    key: str
    value: str
    effect: TaintEffect
    time_added: int  # Unix seconds (the API server keeps whole seconds)


@dataclass(frozen=True)
class DeviceView:
    """One device as the slice, the kubelet and the Events show it."""

    healthy: bool
    message: str
    taints: tuple[DeviceTaint, ...] = ()


HEALTHY = DeviceView(healthy=True, message="")


def label_value(text: str) -> str:
    """`text` as a label value (what a taint's value must be): at most 63 of [A-Za-z0-9_.-]."""
    return _NOT_LABEL.sub("-", text)[:MAX_LABEL_VALUE].strip("-_.")


def device_view(state: DeviceState, driver: str, policy: HealthPolicy) -> DeviceView:
    worst = state.worst
    if worst is None:
        return HEALTHY
    taints = []
    for condition in sorted(state.conditions.values(), key=lambda c: c.category):
        effect = policy.effect(condition.severity)
        if effect is not None:
            taints.append(
                DeviceTaint(f"{driver}/{condition.category}", label_value(condition.reason), effect,
                            int(condition.since))
            )
    return DeviceView(healthy=False, message=worst.message, taints=tuple(taints))


def affected_devices(
    devices: Mapping[str, NodeDevice],
    gpu: int,
    gpu_instance: int | None = None,
    compute_instance: int | None = None,
) -> tuple[str, ...]:
    """The devices an event on GPU `gpu` concerns: the MIG device it names, else all of the GPU's."""
    on_gpu = sorted(name for name, d in devices.items() if d.gpu.index == gpu)
    if gpu_instance is None or gpu_instance == WHOLE_GPU:
        return tuple(on_gpu)
    scoped = tuple(
        name
        for name in on_gpu
        if (mig := devices[name].mig) is not None
        and mig.gpu_instance_id == gpu_instance
        and compute_instance in (None, WHOLE_GPU, mig.compute_instance_id)
    )
    return scoped or tuple(on_gpu)
