"""Simulated-hardware profiles: YAML files that describe a GPU node as NVML would see it.

`load_profile(name_or_path)` finds a profile shipped in `dra_driver/gpu/sim/profiles/<name>.yaml`
(or reads a file path), checks every field and returns a frozen `Profile`; anything wrong
raises ONE `ProfileError` that names the file and the field, before any fake hardware
exists, so nothing half-built is ever used. `list_profiles()` lists the shipped ones.

The profile vocabulary is NVML's (enum names such as `NVIDIA`, `HOPPER`, `NOT_SUPPORTED`,
NVML function names in `errors`), because `dra_driver.gpu.sim.fake_nvml.FakeNvml` replays
it through the same calls the real NVML answers. The file format is documented in
`docs/inventory.md` and by the shipped profiles themselves; what a profile holds, once read,
is `dra_driver.gpu.sim.profile_model`.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import pynvml
import yaml

from dra_driver.gpu.errors import ProfileError
from dra_driver.gpu.nvml import NVML_FUNCTIONS, normalize_pci_bus_id
from dra_driver.gpu.sim.profile_model import (
    FabricSpec,
    GpuSpec,
    MigInstanceSpec,
    MigProfileSpec,
    Profile,
    ProfileSummary,
)
from dra_driver.gpu.sysfs import PCIE_ROOT

PROFILE_SUFFIX = ".yaml"
_GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_MIG_UUID = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_PCI_BUS_ID = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_COMPUTE_CAPABILITY = re.compile(r"^(\d+)\.(\d+)$")
_MIG_SLICES = 8  # memory slices of every MIG-capable GPU so far (A100, H100, H200, B200)


def _nvml_enum(prefix: str) -> dict[str, int]:
    return {
        name[len(prefix) :]: getattr(pynvml, name)
        for name in dir(pynvml)
        if name.startswith(prefix) and isinstance(getattr(pynvml, name), int)
    }


BRANDS = _nvml_enum("NVML_BRAND_")
ARCHITECTURES = _nvml_enum("NVML_DEVICE_ARCH_")
NVML_ERRORS = _nvml_enum("NVML_ERROR_")
FABRIC_STATES = _nvml_enum("NVML_GPU_FABRIC_STATE_")
ADDRESSING_MODES = _nvml_enum("NVML_DEVICE_ADDRESSING_MODE_")


class _Fields:
    """Typed access to one YAML mapping, with the dotted path of every key for errors."""

    def __init__(self, path: str, where: str, data: object, origins: Mapping[str, str] | None = None) -> None:
        if not isinstance(data, dict):
            raise ProfileError(path, where, f"expected a mapping, got {_kind(data)}")
        self.path = path
        self.where = where
        self.data: dict[str, Any] = data
        self.origins = dict(origins or {})
        self.used: set[str] = set()

    def at(self, key: str) -> str:
        base = self.origins.get(key, self.where)
        return f"{base}.{key}" if base else key

    def fail(self, key: str, problem: str) -> ProfileError:
        return ProfileError(self.path, self.at(key), problem)

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, required: bool) -> Any:
        self.used.add(key)
        if key not in self.data:
            if required:
                raise ProfileError(self.path, self.at(key), "required field is missing")
            return None
        return self.data[key]

    def str_(self, key: str, default: str | None = None) -> str:
        value = self.raw(key, default is None)
        if value is None and default is not None:
            return default
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"expected a non-empty string, got {_kind(value)}")
        return value

    def opt_str(self, key: str) -> str | None:
        value = self.raw(key, False)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"expected a non-empty string or null, got {_kind(value)}")
        return value

    def int_(self, key: str, default: int | None = None, minimum: int = 0) -> int:
        value = self.raw(key, default is None)
        if value is None and default is not None:
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.fail(key, f"expected an integer >= {minimum}, got {_kind(value)}")
        return value

    def opt_int(self, key: str, minimum: int = 0) -> int | None:
        value = self.raw(key, False)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.fail(key, f"expected an integer >= {minimum} or null, got {_kind(value)}")
        return value

    def bool_(self, key: str, default: bool) -> bool:
        value = self.raw(key, False)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {_kind(value)}")
        return value

    def enum(self, key: str, table: Mapping[str, int], default: str | None = None) -> int:
        name = self.str_(key, default)
        if name not in table:
            raise self.fail(key, f"unknown value {name!r}; one of: {', '.join(sorted(table))}")
        return table[name]

    def opt_enum(self, key: str, table: Mapping[str, int]) -> int | None:
        return None if self.opt_str(key) is None else self.enum(key, table)

    def list_(self, key: str) -> list[Any]:
        value = self.raw(key, False)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(key, f"expected a list, got {_kind(value)}")
        return value

    def sub(self, key: str) -> _Fields | None:
        value = self.raw(key, False)
        if value is None:
            return None
        return _Fields(self.path, self.at(key), value)

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            raise ProfileError(self.path, self.at(unknown[0]), "unknown field")


def _kind(value: object) -> str:
    if value is None:
        return "nothing"
    return f"{type(value).__name__} {value!r}"[:80]


def _errors(f: _Fields, key: str) -> dict[str, int]:
    sub = f.sub(key)
    if sub is None:
        return {}
    result = {}
    for function in sub.data:
        if function not in NVML_FUNCTIONS:
            raise sub.fail(
                str(function), f"not an NVML call the discovery makes; one of: {', '.join(NVML_FUNCTIONS)}"
            )
        result[function] = sub.enum(function, NVML_ERRORS)
    return result


def _answers(f: _Fields, key: str) -> dict[str, Any]:
    """`nvml`: what the GPU answers to the per-GPU queries FakeNvml does not spell out (a fact
    discovery reads that the profiles need not all say): a value, or values by the call's argument."""
    sub = f.sub(key)
    if sub is None:
        return {}
    result: dict[str, Any] = {}
    for function, value in sub.data.items():
        if function not in NVML_FUNCTIONS or not str(function).startswith("nvmlDeviceGet"):
            raise sub.fail(str(function), "not a per-GPU NVML query the discovery makes (nvmlDeviceGet...)")
        values = value.values() if isinstance(value, dict) else [value]
        if not all(isinstance(v, int | str) for v in values) or (
            isinstance(value, dict) and not all(isinstance(k, int) for k in value)
        ):
            raise sub.fail(str(function), f"expected a number or string, or such by argument: {_kind(value)}")
        result[str(function)] = value
    return result


def _int_list(f: _Fields, key: str, items: Sequence[Any], length: int | None = None) -> tuple[int, ...]:
    if length is not None and len(items) != length:
        raise f.fail(key, f"expected {length} integers, got {len(items)}")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in items):
        raise f.fail(key, f"expected integers >= 0, got {items!r}")
    return tuple(items)


def _mig_profiles(f: _Fields) -> dict[str, MigProfileSpec]:
    catalog: dict[str, MigProfileSpec] = {}
    for n, item in enumerate(f.list_("mig_profiles")):
        p = _Fields(f.path, f"mig_profiles[{n}]", item)
        spec = MigProfileSpec(
            name=p.str_("name"),
            id=p.int_("id"),
            slices=p.int_("slices", minimum=1),
            memory_mib=p.int_("memory_mib", minimum=1),
            multiprocessors=p.int_("multiprocessors", minimum=1),
            copy_engines=p.int_("copy_engines", 0),
            decoders=p.int_("decoders", 0),
            encoders=p.int_("encoders", 0),
            jpeg_engines=p.int_("jpeg_engines", 0),
            ofa_engines=p.int_("ofa_engines", 0),
            placements=_int_list(p, "placements", p.list_("placements")),
            placement_size=p.int_("placement_size", minimum=1),
        )
        p.done()
        if spec.name in catalog:
            raise p.fail("name", f"MIG profile {spec.name!r} is listed twice")
        if not spec.placements or any(s + spec.placement_size > _MIG_SLICES for s in spec.placements):
            raise p.fail("placements", f"each placement must fit in {_MIG_SLICES} memory slices")
        catalog[spec.name] = spec
    return catalog


def _mig(f: _Fields, catalog: Mapping[str, MigProfileSpec]) -> tuple[bool, int, tuple[MigInstanceSpec, ...]]:
    m = f.sub("mig")
    if m is None:
        return False, 0, ()
    enabled = m.bool_("enabled", False)
    max_devices = m.int_("max_devices", 0)
    devices = []
    used_slices: dict[int, str] = {}
    gi_ids: set[int] = set()
    for n, item in enumerate(m.list_("devices")):
        d = _Fields(f.path, f"{m.where}.devices[{n}]", item)
        profile_name = d.str_("profile")
        if profile_name not in catalog:
            raise d.fail("profile", f"no such MIG profile in mig_profiles: {profile_name!r}")
        profile = catalog[profile_name]
        placement = d.int_("placement")
        if placement not in profile.placements:
            raise d.fail("placement", f"{profile_name} can start only at slices {list(profile.placements)}")
        for s in range(placement, placement + profile.placement_size):
            if s in used_slices:
                raise d.fail("placement", f"memory slice {s} is already used by {used_slices[s]}")
            used_slices[s] = f"devices[{n}]"
        gi = d.int_("gpu_instance_id")
        if gi in gi_ids:
            raise d.fail("gpu_instance_id", f"GPU instance id {gi} is used twice")
        gi_ids.add(gi)
        mig_uuid = d.str_("uuid")
        if not _MIG_UUID.match(mig_uuid):
            raise d.fail("uuid", f"expected MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, got {mig_uuid!r}")
        devices.append(MigInstanceSpec(profile, placement, gi, d.int_("compute_instance_id", 0), mig_uuid))
        d.done()
    m.done()
    if devices and not enabled:
        raise m.fail("devices", "MIG devices listed while MIG is not enabled")
    if len(devices) > max_devices:
        raise m.fail("devices", f"{len(devices)} devices but max_devices is {max_devices}")
    return enabled, max_devices, tuple(devices)


def _fabric(f: _Fields) -> FabricSpec | None:
    fab = f.sub("fabric")
    if fab is None:
        return None
    state = fab.enum("state", FABRIC_STATES)
    text = fab.opt_str("cluster_uuid")
    try:
        cluster = uuid.UUID(text).bytes if text else bytes(16)
    except ValueError as err:
        raise fab.fail("cluster_uuid", f"not a UUID: {text!r}") from err
    spec = FabricSpec(state=state, cluster_uuid=cluster, clique_id=fab.int_("clique_id", 0))
    fab.done()
    return spec


def _gpu(
    f: _Fields, index: int, catalog: Mapping[str, MigProfileSpec], switches: int, pair_links: int
) -> GpuSpec:
    gpu_uuid = f.str_("uuid")
    if not _GPU_UUID.match(gpu_uuid):
        raise f.fail(
            "uuid", f"expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (lower-case hex), got {gpu_uuid!r}"
        )
    bus = f.str_("pci_bus_id")
    if not _PCI_BUS_ID.match(bus):
        raise f.fail("pci_bus_id", f"expected a PCI bus id like 00000000:18:00.0, got {bus!r}")
    cc_text = f.raw("cuda_compute_capability", True)
    cc = _COMPUTE_CAPABILITY.match(cc_text) if isinstance(cc_text, str) else None
    if cc is None:
        raise f.fail(
            "cuda_compute_capability", f'expected a quoted "major.minor" string, got {_kind(cc_text)}'
        )
    numa = f.opt_int("numa_node")
    sysfs_numa = f.int_("sysfs_numa_node", numa if numa is not None else -1, minimum=-1)
    root = f.opt_str("pcie_root")
    if root is not None and not PCIE_ROOT.match(root):
        raise f.fail("pcie_root", f"expected pciDDDD:BB (lower-case hex), got {root!r}")
    nvswitch_links = _int_list(
        f, "nvswitch_links", f.list_("nvswitch_links"), switches if f.has("nvswitch_links") else 0
    )
    used_links = pair_links + sum(nvswitch_links)
    max_links = f.int_("nvlink_max_links", used_links)
    if max_links > pynvml.NVML_NVLINK_MAX_LINKS:
        raise f.fail("nvlink_max_links", f"NVML knows at most {pynvml.NVML_NVLINK_MAX_LINKS} links")
    if used_links > max_links:
        raise f.fail("nvlink_max_links", f"the GPU uses {used_links} links (nvlink_pairs + nvswitch_links)")
    mig_enabled, mig_max, mig_devices = _mig(f, catalog)
    spec = GpuSpec(
        index=index,
        uuid=gpu_uuid,
        name=f.str_("name"),
        brand=f.enum("brand", BRANDS),
        architecture=f.enum("architecture", ARCHITECTURES),
        compute_capability=(int(cc.group(1)), int(cc.group(2))),
        memory_bytes=f.int_("memory_bytes", minimum=1),
        pci_bus_id=bus,
        minor=f.int_("minor", index),
        numa_node=numa,
        sysfs_numa_node=sysfs_numa,
        pcie_root=root,
        pcie_switch=f.opt_str("pcie_switch"),
        nvlink_max_links=max_links,
        nvswitch_links=nvswitch_links,
        mig_enabled=mig_enabled,
        mig_max_devices=mig_max,
        mig_devices=mig_devices,
        fabric=_fabric(f),
        errors=_errors(f, "errors"),
        addressing_mode=f.opt_enum("addressing_mode", ADDRESSING_MODES),
        nvml=_answers(f, "nvml"),
    )
    f.done()
    return spec


def _pairs(f: _Fields, gpu_count: int) -> tuple[tuple[int, int, int], ...]:
    pairs: list[tuple[int, int, int]] = []
    seen: set[frozenset[int]] = set()
    for n, item in enumerate(f.list_("nvlink_pairs")):
        key = f"nvlink_pairs[{n}]"
        if not isinstance(item, list):
            raise ProfileError(f.path, key, f"expected [gpu a, gpu b, links], got {_kind(item)}")
        a, b, links = _int_list(f, "nvlink_pairs", item, 3)
        if a == b or a >= gpu_count or b >= gpu_count or links < 1:
            raise ProfileError(
                f.path, key, f"expected two different GPU indexes < {gpu_count} and links >= 1"
            )
        if frozenset((a, b)) in seen:
            raise ProfileError(f.path, key, f"GPUs {a} and {b} are listed twice")
        seen.add(frozenset((a, b)))
        pairs.append((a, b, links))
    return tuple(pairs)


def parse_profile(data: object, path: str, default_name: str) -> Profile:
    """Validate an already-loaded YAML document; `path` only labels errors."""
    top = _Fields(path, "", data)
    driver = top.sub("driver")
    if driver is None:
        raise top.fail("driver", "required field is missing")
    driver_version = driver.str_("version")
    cuda_version = driver.int_("cuda_version", minimum=1000)
    driver.done()
    catalog = _mig_profiles(top)
    switches: list[str | None] = []
    for n, item in enumerate(top.list_("nvswitches")):
        s = _Fields(path, f"nvswitches[{n}]", item)
        s.opt_str("name")  # for the reader only
        bus = s.opt_str("pci_bus_id")  # null: off the node, NVML reports no PCI info for it
        if bus is not None and not _PCI_BUS_ID.match(bus):
            raise s.fail("pci_bus_id", f"expected a PCI bus id like 00000000:05:00.0, got {bus!r}")
        switches.append(bus)
        s.done()
    defaults = top.sub("gpu_defaults")
    default_data = defaults.data if defaults else {}
    raw_gpus = top.list_("gpus")
    if not raw_gpus:
        raise top.fail("gpus", "at least one GPU is required")
    pairs = _pairs(top, len(raw_gpus))
    gpus = []
    for n, item in enumerate(raw_gpus):
        if not isinstance(item, dict):
            raise ProfileError(path, f"gpus[{n}]", f"expected a mapping, got {_kind(item)}")
        merged = {**default_data, **item}
        origins = {key: "gpu_defaults" for key in default_data if key not in item}
        pair_links = sum(links for a, b, links in pairs if n in (a, b))
        gpus.append(_gpu(_Fields(path, f"gpus[{n}]", merged, origins), n, catalog, len(switches), pair_links))
    _check_unique(path, gpus)
    profile = Profile(
        name=top.str_("name", default_name),
        description=top.str_("description", default_name),
        path=path,
        driver_version=driver_version,
        cuda_driver_version=cuda_version,
        gpus=tuple(gpus),
        nvlink_pairs=pairs,
        nvswitches=tuple(switches),
        errors=_errors(top, "errors"),
    )
    top.done()
    return profile


def _check_unique(path: str, gpus: Sequence[GpuSpec]) -> None:
    for attribute in ("uuid", "pci_bus_id", "minor"):
        seen: dict[object, int] = {}
        for g in gpus:
            value = getattr(g, attribute)
            key = normalize_pci_bus_id(value) if attribute == "pci_bus_id" else value
            if key in seen:
                raise ProfileError(
                    path, f"gpus[{g.index}].{attribute}", f"same value as gpus[{seen[key]}]: {value!r}"
                )
            seen[key] = g.index
    mig_uuids: set[str] = set()
    for g in gpus:
        for n, m in enumerate(g.mig_devices):
            if m.uuid in mig_uuids:
                raise ProfileError(path, f"gpus[{g.index}].mig.devices[{n}].uuid", f"used twice: {m.uuid}")
            mig_uuids.add(m.uuid)


def _shipped() -> Path:
    return Path(str(resources.files("dra_driver.gpu.sim").joinpath("profiles")))


def profile_names() -> tuple[str, ...]:
    """The profiles shipped with the driver, by name."""
    return tuple(sorted(p.stem for p in _shipped().glob(f"*{PROFILE_SUFFIX}")))


def resolve_profile_path(name_or_path: str) -> Path:
    """A shipped profile's file for a bare name, else the path as given."""
    looks_like_path = "/" in name_or_path or name_or_path.endswith((".yaml", ".yml"))
    if not looks_like_path:
        shipped = _shipped() / f"{name_or_path}{PROFILE_SUFFIX}"
        if shipped.is_file():
            return shipped
        raise ProfileError(
            name_or_path,
            "",
            f"no such profile; shipped profiles: {', '.join(profile_names())} (or give a file path)",
        )
    return Path(name_or_path)


def load_profile(name_or_path: str) -> Profile:
    """Load and validate a profile by shipped name (`hgx-h200`) or by file path."""
    path = resolve_profile_path(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ProfileError(str(path), "", f"cannot read the file: {err.strerror or err}") from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ProfileError(str(path), where, f"not valid YAML: {problem}") from err
    return parse_profile(data, str(path), path.stem)


def list_profiles() -> tuple[ProfileSummary, ...]:
    summaries = []
    for name in profile_names():
        p = load_profile(name)
        summaries.append(ProfileSummary(p.name, p.description, len(p.gpus), p.gpus[0].name))
    return tuple(summaries)
