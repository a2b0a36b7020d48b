"""The driver's opaque claim configuration (GPU sharing) and its validation.

A ResourceClaim (or its DeviceClass) can carry configuration for this driver:

    spec.devices.config[]:
      - requests: [gpu]                 # optional; empty = every request of the claim
        opaque:
          driver: gpu.dra-driver.dev
          parameters:
            apiVersion: gpu.dra-driver.dev/v1alpha1
            kind: GpuConfig
            sharing:
              strategy: MPS             # or TimeSlicing (the GPU's default behaviour)
              mps:
                defaultActiveThreadPercentage: 50
                defaultPinnedDeviceMemoryLimit: 10Gi

The scheduler copies class and claim entries into `status.allocation.devices.config[]`
(with `source: FromClass|FromClaim`); that copy is what the plugin reads, so what it
prepares is what was allocated. `device_configs` resolves which configuration applies to
each allocated device: entries of another driver are ignored; a claim's entry wins over a
class's; among entries of one source the later wins (the order in which the API lists them).

Validation is strict: an unknown field, a quantity that is not one, a percentage outside
1..100 or an unknown strategy is an error whose message names the field and says what to
write instead, because the kubelet shows it to the user verbatim. Pure functions and
frozen dataclasses only: nothing here does I/O or starts anything (see `dra_driver.sharing.mps`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final

from dra_driver.sharing import rules
from dra_driver.sharing.rules import LIMIT_REASON, MAX_MEMORY, MIN_MEMORY, OURS, Check, Field

API_VERSION: Final = "v1alpha1"
KIND: Final = "GpuConfig"
DEFAULT_GROUP: Final = "gpu.dra-driver.dev"
# The /dev/shm of an MPS or share claim: a tmpfs of its own of this size unless `mps.shmSize`
# says otherwise; what containerd and Docker give every container's /dev/shm.
DEFAULT_SHM_SIZE: Final = 64 * 2**20
NVIDIA_API_VERSION: Final = "resource.nvidia.com/v1beta1"  # read by nvidia_config.py

# The syntax of a Kubernetes resource.Quantity. Parsed here rather than with the client's
# `parse_quantity`, which is lenient ("NaN", "1e3Gi") and whose import pulls the whole
# generated client into the daemon's memory.
_QUANTITY = re.compile(
    r"([+-]?(?:[0-9]*\.?[0-9]+|[0-9]+\.))"  # the number
    r"(?:(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])|[eE]([+-]?[0-9]+))?"  # a binary or decimal suffix, or an exponent
)
_INDEX_KEY = re.compile(r"[0-9]+")
_UUID_KEY = re.compile(r"(GPU|MIG)-[0-9A-Za-z-]+")
_SUFFIX: Final = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate("kMGTPE")},
    **{s: Decimal(1000) ** -(i + 1) for i, s in enumerate("mun")},
}
# The plugin also refuses a limit above the allocated GPU's own memory (dra_driver.sharing.policy).
ParametersParser = Callable[[object, str, str], "GpuConfig"]  # (parameters, driver, where)


class ConfigError(ValueError):
    """The claim's configuration for this driver is not valid; the message says how to fix it."""


class SharingStrategy(enum.StrEnum):
    TIME_SLICING = "TimeSlicing"  # the GPU's default: processes take turns; nothing is started
    MPS = "MPS"  # one CUDA MPS control daemon per claim, with the limits below


@dataclass(frozen=True)
class MpsConfig:
    """Limits every MPS client of the claim gets (None: MPS's own default, no limit)."""

    default_active_thread_percentage: int | None = None
    default_pinned_device_memory_limit: int | None = None  # bytes
    # NVIDIA's defaultPerDevicePinnedMemoryLimit (device index or UUID, bytes) until
    # nvidia_config.per_device resolves it into each device's own limit above
    per_device_pinned_memory_limits: tuple[tuple[str, int], ...] = ()
    shm_size: int | None = None  # bytes of the claim's /dev/shm tmpfs; None: DEFAULT_SHM_SIZE


@dataclass(frozen=True)
class SharingConfig:
    strategy: SharingStrategy = SharingStrategy.TIME_SLICING
    mps: MpsConfig | None = None  # set iff strategy is MPS


@dataclass(frozen=True)
class GpuConfig:
    """One validated `GpuConfig` object."""

    sharing: SharingConfig = SharingConfig()
    nvidia_kind: str | None = None  # GpuConfig or MigDeviceConfig when written in NVIDIA's API

    @property
    def uses_mps(self) -> bool:
        return self.sharing.strategy is SharingStrategy.MPS


DEFAULT_CONFIG: Final = GpuConfig()


# --------------------------------------------------------------------------- quantities


def quantity_value(text: str) -> Decimal | None:
    """The value of a Kubernetes quantity ("10Gi", "143771Mi", "40G", "1e9", "1500m"); None
    if `text` is not one (by the API server's grammar: no spaces, so that a value the
    admission policy refuses is never read here): kubernetes.utils.parse_quantity accepts what
    the policy refuses, so claim configs cannot use it (dra_driver.explain, which reads what the
    API server already accepted, does)."""
    match = _QUANTITY.fullmatch(text)
    if match is None:
        return None
    number, suffix, exponent = match.groups()
    if suffix:
        return Decimal(number) * _SUFFIX[suffix]
    return Decimal(number).scaleb(int(exponent or 0))


def memory_quantity(value: object, where: str, reason: str = LIMIT_REASON) -> int:
    """Bytes of a memory quantity (a string quantity or a whole number) from MIN_MEMORY to
    MAX_MEMORY, fractions of a byte dropped; the admission policy applies the same rule."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{where}: {reason}")
    total = Decimal(value) if isinstance(value, int) else quantity_value(value)
    if total is None or not MIN_MEMORY <= total <= MAX_MEMORY:
        raise ConfigError(f"{where}: {reason}")
    return int(total)


def format_mps_memory(limit_bytes: int) -> str:
    """A byte count in the units CUDA MPS reads (binary: `G` = GiB, `M` = MiB), rounded down
    to whole MiB so that the enforced limit never exceeds the configured one."""
    mib = limit_bytes // 2**20
    if mib < 1:
        raise ConfigError(f"an MPS memory limit must be at least 1Mi, not {limit_bytes} bytes")
    return f"{mib // 1024}G" if mib % 1024 == 0 else f"{mib}M"


# --------------------------------------------------------------------------- the object


def _one_line(text: str) -> str:
    """Line breaks written as repr() writes them (the API server drops a policy message
    that holds one)."""
    return text.replace("\n", "\\n").replace("\r", "\\r")


def check_fields(obj: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    """Refuses unknown fields, naming the first in code-point order and how many more (the
    admission policy says the same: its CEL has no sort in Kubernetes 1.34)."""
    unknown = sorted(str(k) for k in set(obj) - set(allowed))
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise ConfigError(
            f"{where}: unknown field{'s' if more else ''} '{_one_line(unknown[0])}'{more}; "
            f"allowed: {', '.join(allowed)}"
        )


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be an object, not {type(value).__name__} {value!r}")
    return value


def check_value(field: Field, value: object, where: str) -> Any:
    """Runs one row of the rules table on a field's value (None: left out or null, which every
    row takes as unset): the value as the config keeps it, or ConfigError with the row's reason."""
    if value is None or field.check is Check.STRUCTURE:
        return value
    if field.check is Check.PERCENTAGE:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
            zero = field.zero_reason and type(value) is int and value == 0
            reason = field.zero_reason if zero else field.reason
            raise ConfigError(f"{where}: {value!r} {reason}" if field.echo else f"{where}: {reason}")
        return value
    if field.check is Check.MEMORY:
        return memory_quantity(value, where, field.reason)
    if field.check is Check.MEMORY_MAP:
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and (_INDEX_KEY.fullmatch(k) or _UUID_KEY.fullmatch(k)) for k in value
        ):
            raise ConfigError(f"{where}: {field.reason}")
        return tuple(sorted((k, memory_quantity(v, where, field.reason)) for k, v in value.items()))
    if field.check is Check.FALSE:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {field.reason}")
        if value:
            raise ConfigError(f"{where}: {field.true_reason}")
        return value
    if value != "Default":  # Check.DEFAULT
        raise ConfigError(f"{where}: {field.reason}")
    return value


def check_values(obj: Mapping[str, Any], form: str, parent: str, where: str) -> dict[str, Any]:
    """Every row of one object run on it, by field name."""
    return {f.name: check_value(f, obj.get(f.name), f"{where}.{f.name}") for f in rules.values(form, parent)}


def _parse_mps(value: object, where: str) -> MpsConfig:
    obj = _mapping(value, where)
    check_fields(obj, rules.allowed(OURS, "sharing.mps"), where)
    got = check_values(obj, OURS, "sharing.mps", where)
    return MpsConfig(
        default_active_thread_percentage=got["defaultActiveThreadPercentage"],
        default_pinned_device_memory_limit=got["defaultPinnedDeviceMemoryLimit"],
        shm_size=got["shmSize"],
    )


def _parse_sharing(value: object, where: str) -> SharingConfig:
    obj = _mapping(value, where)
    interval = next((k for k in ("timeSlicing", "timeSlicingConfig") if k in obj), None)
    if interval is not None:  # what NVIDIA's driver accepts; users coming from it will write it
        raise ConfigError(
            f"{where}.{interval}: a time-slice interval cannot be set per claim on this driver (NVML "
            "has no call for it, and nvidia-smi compute-policy would change it for every claim on "
            f"the GPU); remove {interval}: a GPU shared by several pods is time-sliced with the "
            "driver's default interval, or use strategy MPS for limits"
        )
    check_fields(obj, rules.allowed(OURS, "sharing"), where)
    raw = obj.get("strategy")
    choices = ", ".join(s.value for s in SharingStrategy)
    if raw is None:
        raise ConfigError(f"{where}.strategy is missing; set it to one of: {choices}")
    try:
        strategy = SharingStrategy(raw)
    except ValueError:
        raise ConfigError(
            f"{where}.strategy: {raw!r} is not a sharing strategy; use one of: {choices}"
        ) from None
    mps = obj.get("mps")  # null: left out, as in NVIDIA's form (nvidia_config.py)
    if strategy is SharingStrategy.MPS:
        return SharingConfig(strategy, _parse_mps({} if mps is None else mps, f"{where}.mps"))
    if mps is not None:
        raise ConfigError(f"{where}.mps is only allowed with strategy MPS (the strategy is {strategy.value})")
    return SharingConfig(strategy)


def parse_gpu_config(parameters: object, driver: str = DEFAULT_GROUP, where: str = "parameters") -> GpuConfig:
    """Validate one `opaque.parameters` object of this driver."""
    obj = _mapping(parameters, where)
    check_fields(obj, rules.allowed(OURS, ""), where)
    accepted = [*sorted({f"{driver}/{API_VERSION}", f"{DEFAULT_GROUP}/{API_VERSION}"}), NVIDIA_API_VERSION]
    if obj.get("apiVersion") not in accepted:
        raise ConfigError(
            f"{where}.apiVersion: {obj.get('apiVersion')!r} is not supported; use {' or '.join(accepted)}"
        )
    if obj.get("kind") is None:
        raise ConfigError(f"{where}.kind is missing; set it to {KIND}")
    if obj.get("kind") != KIND:
        raise ConfigError(f"{where}.kind: {obj.get('kind')!r} is not supported; use {KIND}")
    if obj.get("sharing") is None:  # left out or null: nothing shared, as NVIDIA reads its own
        return GpuConfig()
    return GpuConfig(sharing=_parse_sharing(obj["sharing"], f"{where}.sharing"))


# --------------------------------------------------------------------------- a claim's entries


@dataclass(frozen=True)
class ConfigEntry:
    """One `status.allocation.devices.config[]` entry of this driver, validated."""

    requests: tuple[str, ...]  # empty: every request
    from_class: bool
    config: GpuConfig

    def applies_to(self, request: str) -> bool:
        """`request` is a result's request name, `main` or `main/subrequest`; an entry naming
        the main request covers all its subrequests."""
        return not self.requests or request in self.requests or request.split("/", 1)[0] in self.requests


def claim_config_entries(
    claim: Mapping[str, Any], driver: str, parse: ParametersParser = parse_gpu_config
) -> tuple[ConfigEntry, ...]:
    """This driver's entries of the claim's allocation, in the order the API lists them;
    `parse` reads one entry's parameters (nvidia_config.parse_claim_config also reads NVIDIA's)."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    raw = (allocation.get("devices") or {}).get("config") or []
    if not isinstance(raw, list):
        raise ConfigError("status.allocation.devices.config is not a list")
    entries: list[ConfigEntry] = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            continue
        opaque = item.get("opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        source = item.get("source", "FromClaim")
        origin = "the DeviceClass" if source == "FromClass" else "the claim"
        where = f"config[{i}] (from {origin}) opaque.parameters"
        requests = item.get("requests") or []
        if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
            raise ConfigError(f"config[{i}].requests must be a list of request names")
        entries.append(
            ConfigEntry(
                requests=tuple(requests),
                from_class=source == "FromClass",
                config=parse(opaque.get("parameters"), driver, where),
            )
        )
    return tuple(entries)


def config_for_request(entries: Sequence[ConfigEntry], request: str) -> GpuConfig:
    """The configuration of one allocated request: claim entries over class entries, later over
    earlier, whether or not an entry names the request (NVIDIA's driver picks the same way; two
    entries that disagree are not an error: docs/migrating.md, "Several configs in one claim")."""
    chosen = DEFAULT_CONFIG
    for from_class in (True, False):
        for entry in entries:
            if entry.from_class == from_class and entry.applies_to(request):
                chosen = entry.config
    return chosen


def device_requests(claim: Mapping[str, Any], driver: str, pool: str) -> dict[str, frozenset[str]]:
    """The main requests each device this driver allocated in `pool` serves: a container
    that names a request gets only that request's devices."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    out: dict[str, set[str]] = {}
    for result in (allocation.get("devices") or {}).get("results") or []:
        if isinstance(result, Mapping) and result.get("driver") == driver and result.get("pool") == pool:
            request = str(result.get("request", "")).split("/", 1)[0]
            out.setdefault(str(result.get("device", "")), set()).add(request)
    return {device: frozenset(requests) for device, requests in out.items()}


def device_configs(
    claim: Mapping[str, Any], driver: str, pool: str, parse: ParametersParser = parse_gpu_config
) -> dict[str, GpuConfig]:
    """The configuration of every device this driver allocated in `pool`, by device name.

    A device allocated for two requests of one claim must get one configuration: if the
    two differ the claim is refused (a device has one sharing mode)."""
    entries = claim_config_entries(claim, driver, parse)
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    out: dict[str, GpuConfig] = {}
    for result in results:
        if not isinstance(result, Mapping) or result.get("driver") != driver or result.get("pool") != pool:
            continue
        device, request = str(result.get("device", "")), str(result.get("request", ""))
        config = config_for_request(entries, request)
        if device in out and out[device] != config:
            raise ConfigError(
                f"device {device} is allocated to several requests of this claim with different "
                "configurations; give them the same sharing configuration"
            )
        out[device] = config
    return out
