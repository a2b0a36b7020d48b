"""NVIDIA's claim configuration (`resource.nvidia.com/v1beta1`) read as this driver's own.

A claim written for NVIDIA's GPU DRA driver carries its sharing settings as:

    opaque:
      driver: gpu.dra-driver.dev              # was gpu.nvidia.com: the one edit a user makes
      parameters:
        apiVersion: resource.nvidia.com/v1beta1
        kind: GpuConfig                       # or MigDeviceConfig
        sharing:
          strategy: MPS                       # or TimeSlicing
          mpsConfig:
            defaultActiveThreadPercentage: 50
            defaultPinnedDeviceMemoryLimit: 10Gi
            defaultPerDevicePinnedMemoryLimit: {"0": 5Gi}   # device index or UUID

`parse_nvidia_config` maps that onto `GpuConfig` (`parse_claim_config` reads either form: the
plugin hands it to config.py's `device_configs`) (docs/migrating.md has the table). A field
this driver cannot honour is refused with the reason, never ignored. The reasons are
module constants because the chart's admission policy
(deploy/helm/gpu-dra-driver/templates/claim-config-policy.yaml) refuses the same configs
with the same text when the claim is written; tests/unit/test_nvidia_config.py checks that
each one is in the template. `per_device` resolves NVIDIA's per-device memory limits once
the allocated devices are known (a device index counts the devices the config applies to,
in allocation order, as NVIDIA's driver counts them).

Pure functions only: nothing here does I/O, and it knows nothing of MPS daemons or CDI.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

from dra_driver.sharing import rules
from dra_driver.sharing.config import (
    DEFAULT_GROUP,
    NVIDIA_API_VERSION,
    ConfigError,
    GpuConfig,
    MpsConfig,
    SharingConfig,
    SharingStrategy,
    check_fields,
    check_values,
    parse_gpu_config,
)
from dra_driver.sharing.rules import NVIDIA

if TYPE_CHECKING:
    from dra_driver.devices import NodeDevice

API_VERSION: Final = NVIDIA_API_VERSION
GPU_KIND: Final = "GpuConfig"
MIG_KIND: Final = "MigDeviceConfig"
KINDS: Final = (GPU_KIND, MIG_KIND)

# The refusals, word for word what the admission policy says (after the field's path).
KIND_REASON: Final = (
    "must be GpuConfig (whole GPUs) or MigDeviceConfig (MIG devices), the kinds of this API "
    "version this driver reads"
)
NO_COUNTERPART_REASON: Final = (
    "has no counterpart on this driver: it offers no VFIO passthrough and no IMEX compute "
    "domains; ask for a GPU (kind GpuConfig) or a MIG device (kind MigDeviceConfig)"
)
# NVIDIA's kinds with no counterpart here, answered with NO_COUNTERPART_REASON
NVIDIA_ONLY_KINDS: Final = ("VfioDeviceConfig", "ComputeDomainChannelConfig", "ComputeDomainDaemonConfig")
STRATEGY_REASON: Final = "must be TimeSlicing or MPS"
MPS_ONLY_REASON: Final = "is only allowed with strategy MPS"
TIME_SLICING_ONLY_REASON: Final = "is only allowed with strategy TimeSlicing (and only in a GpuConfig)"
# What to change besides the kind, when the kind does not fit the device allocated.
MIG_CLASS_HINT: Final = " (or ask for a whole GPU with class gpu.<driver> to keep GpuConfig)"
GPU_CLASS_HINT: Final = " (or ask for a MIG device with class mig.<driver> to keep MigDeviceConfig)"

# the refusals of the parser's own code; each row's reason is in the rules table
_OWN_REASONS: Final = (
    KIND_REASON,
    NO_COUNTERPART_REASON,
    STRATEGY_REASON,
    MPS_ONLY_REASON,
    TIME_SLICING_ONLY_REASON,
)


def reasons() -> tuple[str, ...]:
    """Every refusal's text (the admission policy must carry each of them verbatim)."""
    return _OWN_REASONS + rules.reasons(NVIDIA)


def _refuse(where: str, reason: str) -> ConfigError:
    return ConfigError(f"{where}: {reason}")


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be an object")
    return value


def _parse_mps(value: object, where: str) -> MpsConfig:
    obj = _mapping(value, where)
    check_fields(obj, rules.allowed(NVIDIA, "sharing.mpsConfig"), where)
    got = check_values(obj, NVIDIA, "sharing.mpsConfig", where)
    return MpsConfig(
        default_active_thread_percentage=got["defaultActiveThreadPercentage"],
        default_pinned_device_memory_limit=got["defaultPinnedDeviceMemoryLimit"],
        per_device_pinned_memory_limits=got["defaultPerDevicePinnedMemoryLimit"] or (),
    )


def _parse_sharing(value: object, kind: str, where: str) -> SharingConfig:
    obj = _mapping(value, where)
    allowed = rules.allowed(NVIDIA, "sharing", kind)
    # A MigDeviceConfig has no timeSlicingConfig field at all: NVIDIA's strict decoder refuses
    # the key whatever its value, null included.
    if kind == MIG_KIND and "timeSlicingConfig" in obj:
        raise _refuse(f"{where}.timeSlicingConfig", TIME_SLICING_ONLY_REASON)
    check_fields(obj, allowed, where)
    raw = obj.get("strategy")
    if raw not in (SharingStrategy.TIME_SLICING.value, SharingStrategy.MPS.value):
        raise _refuse(f"{where}.strategy", STRATEGY_REASON)
    strategy = SharingStrategy(raw)
    # A null field is a field left out, as NVIDIA's decoder reads it (a nil pointer), and
    # what NVIDIA's Normalize then defaults: a null timeSlicingConfig is interval Default, a
    # null mpsConfig MPS's own defaults (`kubectl create` leaves `timeSlicingConfig:` null
    # once its interval is removed).
    time_slicing, mps = obj.get("timeSlicingConfig"), obj.get("mpsConfig")
    if strategy is SharingStrategy.MPS:
        if time_slicing is not None:
            raise _refuse(f"{where}.timeSlicingConfig", TIME_SLICING_ONLY_REASON)
        return SharingConfig(strategy, _parse_mps({} if mps is None else mps, f"{where}.mpsConfig"))
    if mps is not None:
        raise _refuse(f"{where}.mpsConfig", MPS_ONLY_REASON)
    if time_slicing is not None:
        ts = _mapping(time_slicing, f"{where}.timeSlicingConfig")
        check_fields(ts, rules.allowed(NVIDIA, "sharing.timeSlicingConfig"), f"{where}.timeSlicingConfig")
        check_values(ts, NVIDIA, "sharing.timeSlicingConfig", f"{where}.timeSlicingConfig")
    return SharingConfig(strategy)


def parse_nvidia_config(obj: Mapping[str, Any], where: str) -> GpuConfig:
    """One `opaque.parameters` object of NVIDIA's API version, as this driver's config.
    Raises ConfigError naming the field and the reason. A kind of NVIDIA's with no
    counterpart here is refused before the fields are checked: its own fields (a
    VfioDeviceConfig's `iommu`, a channel's `domainID`) are no mistake of the user's, the
    kind is."""
    kind = obj.get("kind")
    if kind in NVIDIA_ONLY_KINDS:
        raise _refuse(f"{where}.kind", f"{kind} {NO_COUNTERPART_REASON}")
    check_fields(obj, rules.allowed(NVIDIA, ""), where)
    if kind is None:
        raise ConfigError(f"{where}.kind is missing; {KIND_REASON.replace('must be', 'set it to')}")
    if kind not in KINDS:
        raise _refuse(f"{where}.kind", KIND_REASON)
    if obj.get("sharing") is None:
        return GpuConfig(nvidia_kind=str(kind))
    return GpuConfig(
        sharing=_parse_sharing(obj["sharing"], str(kind), f"{where}.sharing"), nvidia_kind=str(kind)
    )


def parse_claim_config(
    parameters: object, driver: str = DEFAULT_GROUP, where: str = "parameters"
) -> GpuConfig:
    """One `opaque.parameters` object of this driver in either API: NVIDIA's or ours."""
    if isinstance(parameters, Mapping) and parameters.get("apiVersion") == API_VERSION:
        return parse_nvidia_config(parameters, where)
    return parse_gpu_config(parameters, driver, where)


def per_device(
    configs: Mapping[str, GpuConfig], devices: Sequence[NodeDevice], slices: frozenset[str] = frozenset()
) -> dict[str, GpuConfig]:
    """Each device's config with NVIDIA's per-device settings resolved for it: the kind
    checked against the device (GpuConfig for a GPU, MigDeviceConfig for a MIG device, as
    NVIDIA's driver checks; `slices` names the dynamic MIG slices, MIG devices whose
    instance is not made yet) and `defaultPerDevicePinnedMemoryLimit` turned into the
    device's own limit. Devices sharing one config are counted in the order given (the
    allocation's), which is what an index key means."""
    groups: dict[GpuConfig, list[NodeDevice]] = {}
    for d in devices:
        config = configs[d.name]
        if config.nvidia_kind is not None:
            is_mig = d.mig is not None or d.name in slices
            wanted = MIG_KIND if is_mig else GPU_KIND
            if config.nvidia_kind != wanted:
                raise ConfigError(
                    f"cannot apply {config.nvidia_kind} to device {d.name}, a "
                    f"{'MIG device' if is_mig else 'whole GPU'}: use kind {wanted} in the "
                    f"config for its request{MIG_CLASS_HINT if is_mig else GPU_CLASS_HINT}"
                )
        groups.setdefault(config, []).append(d)
    out = dict(configs)
    for config, members in groups.items():
        mps = config.sharing.mps
        if mps is None or not mps.per_device_pinned_memory_limits:
            continue
        limits = {d.uuid: mps.default_pinned_device_memory_limit for d in members}
        for key, value in mps.per_device_pinned_memory_limits:
            if key in limits:
                limits[key] = value
            elif key.isdigit() and int(key) < len(members):
                limits[members[int(key)].uuid] = value
            else:
                names = ", ".join(d.name for d in members)
                raise ConfigError(
                    f"mpsConfig.defaultPerDevicePinnedMemoryLimit: key {key!r} names none of the "
                    f"{len(members)} device(s) this config applies to ({names}): "
                    f"use an index from 0 to {len(members) - 1} or one of their UUIDs"
                )
        for d in members:
            resolved = replace(
                mps, default_pinned_device_memory_limit=limits[d.uuid], per_device_pinned_memory_limits=()
            )
            out[d.name] = replace(config, sharing=replace(config.sharing, mps=resolved))
    return out
