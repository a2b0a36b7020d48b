"""CDI (Container Device Interface) specs: the data model, pure builders, and an atomic writer.

The kubelet hands the container runtime fully-qualified CDI device ids; the runtime looks
them up in spec files in its CDI directories and applies their container edits. This
module turns allocated GPUs plus the node's `DriverFiles` into such specs:

* `build_claim_spec`: one transient spec per claim, one CDI device per allocated device,
  named `<claimUID>-<deviceName>` so a name is never reused (runtimes cache specs);
* `build_static_spec`: one spec for Docker/Podman (`--device <vendor>/gpu=0|<uuid>|all`).

Every spec declares the lowest `cdiVersion` its content needs (`minimum_version`), because
a runtime whose CDI library predates the declared version rejects the whole file.

What a container gets (the reasoning is in `common_edits`): its own `/dev/nvidiaN` (MIG:
the parent's node plus the two MIG access capability nodes), the control nodes, and the
driver's libraries and tools bind-mounted read-only. No hooks are used, so no NVIDIA
binary needs to be installed on the host for the runtime to call.

I/O lives only in the file functions at the bottom (`write_spec`, `remove_claim_spec`,
`claim_uids_in`; atomic writes come from `dra_driver.atomic`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import structlog

from dra_driver import DEFAULT_DRIVER_NAME
from dra_driver.atomic import fsync_dir, write_file_atomic
from dra_driver.driver_root import DeviceNodeInfo, DriverFiles, multiarch_triplet
from dra_driver.gpu.model import GpuInfo, Inventory, MigDevice

log = structlog.get_logger(__name__)

DEFAULT_VENDOR: Final = DEFAULT_DRIVER_NAME
CDI_CLASS: Final = "gpu"
DEFAULT_CDI_DIR: Final = "/var/run/cdi"
STATIC_CDI_DIR: Final = "/etc/cdi"
SPEC_EXTENSION: Final = ".json"

MOUNT_OPTIONS: Final = ("ro", "nosuid", "nodev", "bind")
# Images such as nvidia/cuda set NVIDIA_VISIBLE_DEVICES=all. On a node whose runtime is
# nvidia-container-runtime (legacy or its own CDI mode) that would add every GPU of the
# node on top of the ones this spec grants; "void" makes that runtime leave the container
# alone. Runtimes without the NVIDIA hook ignore the variable.
ISOLATION_ENV: Final = ("NVIDIA_VISIBLE_DEVICES=void",)
DEVICE_ENV_PREFIX: Final = "GPU_DRA_DEVICE_"

KNOWN_VERSIONS: Final = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")


class CdiNameError(ValueError):
    """A vendor, class, device name or claim UID that CDI (or a file name) cannot carry."""


# --------------------------------------------------------------------------- data model


@dataclass(frozen=True)
class DeviceNode:
    """`containerEdits.deviceNodes[]`. `path` is inside the container."""

    path: str
    host_path: str | None = None  # needs cdiVersion 0.5.0
    type: str | None = None  # "c", "b", "u", "p"
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None  # permission bits, written as a JSON number
    permissions: str | None = None  # cgroup access, default "rwm"
    uid: int | None = None
    gid: int | None = None


@dataclass(frozen=True)
class Mount:
    """`containerEdits.mounts[]`."""

    host_path: str
    container_path: str
    options: tuple[str, ...] = ()
    type: str | None = None  # needs cdiVersion 0.4.0


@dataclass(frozen=True)
class Hook:
    """`containerEdits.hooks[]` (modelled for completeness; this driver writes none)."""

    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None


@dataclass(frozen=True)
class ContainerEdits:
    """`containerEdits`: what the runtime adds to the container's OCI spec."""

    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()
    additional_gids: tuple[int, ...] = ()  # needs cdiVersion 0.7.0

    def merged(self, other: ContainerEdits) -> ContainerEdits:
        """Both edits, this one's entries first (the runtime lets a later env key win)."""
        return ContainerEdits(
            env=self.env + other.env,
            device_nodes=self.device_nodes + other.device_nodes,
            mounts=self.mounts + other.mounts,
            hooks=self.hooks + other.hooks,
            additional_gids=self.additional_gids + other.additional_gids,
        )

    def is_empty(self) -> bool:
        return not (self.env or self.device_nodes or self.mounts or self.hooks or self.additional_gids)


@dataclass(frozen=True)
class Device:
    """`devices[]`: one CDI device; `name` is the part after `=` in its qualified id."""

    name: str
    container_edits: ContainerEdits
    annotations: tuple[tuple[str, str], ...] = ()  # needs cdiVersion 0.6.0


@dataclass(frozen=True)
class CdiSpec:
    """One CDI spec file. Its `cdiVersion` is derived from the content, never chosen."""

    kind: str
    devices: tuple[Device, ...]
    container_edits: ContainerEdits = field(default_factory=ContainerEdits)
    annotations: tuple[tuple[str, str], ...] = ()  # needs cdiVersion 0.6.0
    # Not part of the file's content: the claim a transient spec belongs to, which names
    # its file (`write_spec`). None for the static spec.
    claim_uid: str | None = None

    @property
    def cdi_version(self) -> str:
        return minimum_version(self)

    @property
    def vendor(self) -> str:
        return self.kind.partition("/")[0]

    @property
    def cdi_class(self) -> str:
        return self.kind.partition("/")[2]

    def qualified_ids(self) -> tuple[str, ...]:
        return tuple(f"{self.kind}={d.name}" for d in self.devices)


# --------------------------------------------------------------------------- versions


def _all_edits(spec: CdiSpec) -> Iterable[ContainerEdits]:
    yield spec.container_edits
    for d in spec.devices:
        yield d.container_edits


def _needs_0_7_0(spec: CdiSpec) -> bool:
    return any(e.additional_gids for e in _all_edits(spec))


def _needs_0_6_0(spec: CdiSpec) -> bool:
    return bool(spec.annotations) or any(d.annotations for d in spec.devices) or "." in spec.cdi_class


def _needs_0_5_0(spec: CdiSpec) -> bool:
    if any(d.name[:1].isdigit() for d in spec.devices):
        return True
    return any(n.host_path for e in _all_edits(spec) for n in e.device_nodes)


def _needs_0_4_0(spec: CdiSpec) -> bool:
    return any(m.type for e in _all_edits(spec) for m in e.mounts)


# Newest first, as in the CDI library's specs-go/version.go: the first rule that holds wins.
_VERSION_RULES: Final = (
    ("0.7.0", _needs_0_7_0),
    ("0.6.0", _needs_0_6_0),
    ("0.5.0", _needs_0_5_0),
    ("0.4.0", _needs_0_4_0),
)


def minimum_version(spec: CdiSpec) -> str:
    """The lowest cdiVersion whose schema holds everything `spec` uses (0.3.0 at least)."""
    for version, needed in _VERSION_RULES:
        if needed(spec):
            return version
    return "0.3.0"


# --------------------------------------------------------------------------- names

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_CLAIM_UID = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,126}[A-Za-z0-9])?")
_ENV_UNSAFE = re.compile(r"[^A-Z0-9]")


def _check_vendor_or_class(what: str, name: str) -> None:
    if not name:
        raise CdiNameError(f"CDI {what} is empty")
    if not name[0].isascii() or not name[0].isalpha():
        raise CdiNameError(f"CDI {what} {name!r} must start with a letter")
    if not name[-1].isascii() or not name[-1].isalnum():
        raise CdiNameError(f"CDI {what} {name!r} must end with a letter or digit")
    bad = [c for c in name[1:-1] if not (c.isascii() and (c.isalnum() or c in "_.-"))]
    if bad:
        raise CdiNameError(f"CDI {what} {name!r} may not contain {bad[0]!r}")


def validate_vendor(vendor: str) -> None:
    """A CDI vendor that is also a DNS subdomain (the driver name is one)."""
    _check_vendor_or_class("vendor", vendor)
    if len(vendor) > 253:
        raise CdiNameError(f"CDI vendor {vendor!r} is longer than 253 characters")
    for label in vendor.split("."):
        if len(label) > 63 or not _DNS_LABEL.fullmatch(label):
            raise CdiNameError(
                f"CDI vendor {vendor!r} is not a DNS subdomain (lower-case labels of a-z, 0-9, '-')"
            )


def validate_class(cdi_class: str) -> None:
    _check_vendor_or_class("class", cdi_class)
    if len(cdi_class) > 63:
        raise CdiNameError(f"CDI class {cdi_class!r} is longer than 63 characters")


def validate_device_name(name: str) -> None:
    if not name:
        raise CdiNameError("CDI device name is empty")
    if not (name[0].isascii() and name[0].isalnum()) or not (name[-1].isascii() and name[-1].isalnum()):
        raise CdiNameError(f"CDI device name {name!r} must start and end with a letter or digit")
    bad = [c for c in name if not (c.isascii() and (c.isalnum() or c in "_.:-"))]
    if bad:
        raise CdiNameError(f"CDI device name {name!r} may not contain {bad[0]!r}")


def validate_claim_uid(claim_uid: str) -> None:
    """A claim UID that can prefix a CDI device name and sit in a file name."""
    if not _CLAIM_UID.fullmatch(claim_uid):
        raise CdiNameError(
            f"claim UID {claim_uid!r} is not usable in a CDI device or file name "
            "(letters, digits, '.', '_', '-'; at most 128 characters)"
        )


def kind_for(vendor: str = DEFAULT_VENDOR) -> str:
    validate_vendor(vendor)
    return f"{vendor}/{CDI_CLASS}"


def qualified_name(vendor: str, cdi_class: str, name: str) -> str:
    """`vendor/class=name`, validated."""
    validate_vendor(vendor)
    validate_class(cdi_class)
    validate_device_name(name)
    return f"{vendor}/{cdi_class}={name}"


def parse_qualified_name(device_id: str) -> tuple[str, str, str]:
    """(vendor, class, name) of `vendor/class=name`; CdiNameError if it is not one."""
    kind, eq, name = device_id.partition("=")
    vendor, slash, cdi_class = kind.partition("/")
    if not (eq and slash and vendor and cdi_class and name):
        raise CdiNameError(f"{device_id!r} is not a qualified CDI device id (vendor/class=name)")
    _check_vendor_or_class("vendor", vendor)
    validate_class(cdi_class)
    validate_device_name(name)
    return vendor, cdi_class, name


def claim_device_name(claim_uid: str, device_name: str) -> str:
    """The CDI device name of one allocated device of one claim: `<claimUID>-<device>`."""
    validate_claim_uid(claim_uid)
    name = f"{claim_uid}-{device_name}"
    validate_device_name(name)
    return name


def claim_device_id(vendor: str, claim_uid: str, device_name: str) -> str:
    """The qualified id the kubelet passes to the runtime, e.g. `gpu.dra-driver.dev/gpu=<uid>-gpu-0`."""
    return qualified_name(vendor, CDI_CLASS, claim_device_name(claim_uid, device_name))


def device_env_name(device_name: str) -> str:
    """Environment variable naming the UUID of an allocated device, e.g. GPU_DRA_DEVICE_GPU_0_UUID.

    Keyed by device name, so the variables of two claims in one container never collide."""
    return f"{DEVICE_ENV_PREFIX}{_ENV_UNSAFE.sub('_', device_name.upper())}_UUID"


# --------------------------------------------------------------------------- builders


@dataclass(frozen=True)
class ContainerLayout:
    """Where the driver's files appear inside the container."""

    lib_dirs: tuple[str, ...]
    bin_dir: str = "/usr/bin"


def default_layout(machine: str | None = None) -> ContainerLayout:
    """Libraries in the CUDA images' /usr/local/nvidia/lib64 and in the distributions'
    default loader directories; tools in /usr/bin.

    Without a hook nobody runs ldconfig in the container, so the loader must find
    libcuda.so.1 by itself. It searches LD_LIBRARY_PATH, then ld.so.cache, then its
    built-in directories: /lib/<triplet> and /usr/lib/<triplet> on Debian/Ubuntu,
    /lib64 and /usr/lib64 on RHEL-like images. Setting LD_LIBRARY_PATH from the spec
    would replace the image's own value (CDI env overrides by key; NGC images list their
    framework dirs there), so it is not set. CUDA, NGC and PyTorch images already put
    /usr/local/nvidia/lib64 in their LD_LIBRARY_PATH, which tools such as Triton use to
    locate libcuda; the two default directories cover every other glibc image (checked on
    the H200 host: in an image without the driver and without ld.so.cache, libcuda.so.1
    and libnvidia-ml.so.1 load from /usr/lib/x86_64-linux-gnu)."""
    return ContainerLayout(
        lib_dirs=("/usr/local/nvidia/lib64", f"/usr/lib/{multiarch_triplet(machine)}", "/usr/lib64")
    )


class AllocatableDevice(Protocol):
    """A device to put in a spec: a whole GPU, or a MIG device on `gpu` (its parent).
    `dra_driver.devices.NodeDevice` is one."""

    @property
    def name(self) -> str: ...  # the ResourceSlice device name, e.g. "gpu-0"

    @property
    def gpu(self) -> GpuInfo: ...

    @property
    def mig(self) -> MigDevice | None: ...


@dataclass(frozen=True)
class _StaticDevice:
    name: str
    gpu: GpuInfo
    mig: MigDevice | None = None


def _uuid(device: AllocatableDevice) -> str:
    return device.mig.uuid if device.mig is not None else device.gpu.uuid


def _cdi_node(n: DeviceNodeInfo) -> DeviceNode:
    return DeviceNode(
        path=n.path,
        host_path=n.host_path if n.host_path != n.path else None,
        type=n.type,
        major=n.major,
        minor=n.minor,
        file_mode=n.file_mode,
    )


def device_edits(device: AllocatableDevice, files: DriverFiles) -> ContainerEdits:
    """The edits one device needs on its own: its device nodes and its UUID variable."""
    nodes = [files.gpu_node(device.gpu.minor)]
    if device.mig is not None:
        nodes.extend(
            files.mig_cap_nodes(device.gpu.minor, device.mig.gpu_instance_id, device.mig.compute_instance_id)
        )
    return ContainerEdits(
        env=(f"{device_env_name(device.name)}={_uuid(device)}",),
        device_nodes=tuple(_cdi_node(n) for n in nodes),
    )


def common_edits(files: DriverFiles, layout: ContainerLayout | None = None) -> ContainerEdits:
    """The edits every GPU container needs whatever GPUs it got.

    * control nodes (nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia-modeset if present);
    * every library name (real file, SONAME and dev links) bind-mounted read-only from
      the real file into each `layout.lib_dirs` (see `default_layout` for why those);
    * the tools into `layout.bin_dir`;
    * `ISOLATION_ENV`. No CUDA_VISIBLE_DEVICES: the container has only its own
      /dev/nvidiaN, so CUDA and NVML enumerate exactly those, and a spec-level value
      would be overwritten by another claim's in a container that uses two claims.
    """
    lay = layout or default_layout()
    mounts: list[Mount] = []
    for lib in files.libraries:
        for d in lay.lib_dirs:
            mounts.extend(Mount(lib.host_path, f"{d}/{name}", MOUNT_OPTIONS) for name in lib.names)
    mounts.extend(Mount(b.host_path, f"{lay.bin_dir}/{b.name}", MOUNT_OPTIONS) for b in files.binaries)
    return ContainerEdits(
        env=ISOLATION_ENV,
        device_nodes=tuple(_cdi_node(n) for n in files.control_nodes),
        mounts=tuple(mounts),
    )


def build_claim_spec(
    vendor: str,
    claim_uid: str,
    devices: Sequence[AllocatableDevice],
    files: DriverFiles,
    *,
    extra_edits: Mapping[str, ContainerEdits] | None = None,
    layout: ContainerLayout | None = None,
) -> CdiSpec:
    """The transient spec of one claim: one CDI device `<claimUID>-<device>` per allocated
    device; `extra_edits` (by device name, e.g. sharing settings) are added to that device."""
    if not devices:
        raise ValueError(f"claim {claim_uid}: a CDI spec needs at least one device")
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        raise ValueError(f"claim {claim_uid}: device listed twice in {names}")
    extra = extra_edits or {}
    unknown = sorted(set(extra) - set(names))
    if unknown:
        raise ValueError(f"claim {claim_uid}: extra edits for devices not in the claim: {unknown}")
    cdi_devices = tuple(
        Device(
            name=claim_device_name(claim_uid, d.name),
            container_edits=device_edits(d, files).merged(extra.get(d.name, ContainerEdits())),
        )
        for d in devices
    )
    return CdiSpec(
        kind=kind_for(vendor),
        devices=cdi_devices,
        container_edits=common_edits(files, layout),
        claim_uid=claim_uid,
    )


def _union(edits: Iterable[ContainerEdits]) -> ContainerEdits:
    out = ContainerEdits()
    for e in edits:
        out = out.merged(e)
    return out


def build_static_spec(
    inventory: Inventory,
    files: DriverFiles,
    vendor: str = DEFAULT_VENDOR,
    layout: ContainerLayout | None = None,
) -> CdiSpec:
    """A spec for Docker/Podman: each GPU by index (`0`) and by UUID, each MIG device by
    UUID, and `all` (every full GPU). Same edits as a claim's."""
    devices: list[Device] = []
    whole: list[ContainerEdits] = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.index):
        edits = device_edits(_StaticDevice(name=str(gpu.index), gpu=gpu), files)
        whole.append(edits)
        devices.append(Device(name=str(gpu.index), container_edits=edits))
        devices.append(Device(name=gpu.uuid, container_edits=edits))
        for mig in gpu.mig_devices:
            name = f"{gpu.index}:{mig.gpu_instance_id}:{mig.compute_instance_id}"
            devices.append(
                Device(name=mig.uuid, container_edits=device_edits(_StaticDevice(name, gpu, mig), files))
            )
    if not devices:
        raise ValueError("no GPUs in the inventory: a CDI spec needs at least one device")
    devices.append(Device(name="all", container_edits=_union(whole)))
    for d in devices:
        validate_device_name(d.name)
    return CdiSpec(kind=kind_for(vendor), devices=tuple(devices), container_edits=common_edits(files, layout))


# --------------------------------------------------------------------------- JSON


def _edits_to_dict(e: ContainerEdits) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if e.env:
        out["env"] = list(e.env)
    if e.device_nodes:
        out["deviceNodes"] = [_node_to_dict(n) for n in e.device_nodes]
    if e.mounts:
        out["mounts"] = [_mount_to_dict(m) for m in e.mounts]
    if e.hooks:
        out["hooks"] = [_hook_to_dict(h) for h in e.hooks]
    if e.additional_gids:
        out["additionalGids"] = list(e.additional_gids)
    return out


def _node_to_dict(n: DeviceNode) -> dict[str, Any]:
    out: dict[str, Any] = {"path": n.path}
    for key, value in (
        ("hostPath", n.host_path),
        ("type", n.type),
        ("major", n.major),
        ("minor", n.minor),
        ("fileMode", n.file_mode),
        ("permissions", n.permissions),
        ("uid", n.uid),
        ("gid", n.gid),
    ):
        if value is not None:
            out[key] = value
    return out


def _mount_to_dict(m: Mount) -> dict[str, Any]:
    out: dict[str, Any] = {"hostPath": m.host_path, "containerPath": m.container_path}
    if m.options:
        out["options"] = list(m.options)
    if m.type:
        out["type"] = m.type
    return out


def _hook_to_dict(h: Hook) -> dict[str, Any]:
    out: dict[str, Any] = {"hookName": h.hook_name, "path": h.path}
    if h.args:
        out["args"] = list(h.args)
    if h.env:
        out["env"] = list(h.env)
    if h.timeout is not None:
        out["timeout"] = h.timeout
    return out


def spec_to_dict(spec: CdiSpec) -> dict[str, Any]:
    """The spec as CDI's JSON object, with its minimum cdiVersion."""
    out: dict[str, Any] = {"cdiVersion": spec.cdi_version, "kind": spec.kind}
    if spec.annotations:
        out["annotations"] = dict(spec.annotations)
    devices: list[dict[str, Any]] = []
    for d in spec.devices:
        dev: dict[str, Any] = {"name": d.name}
        if d.annotations:
            dev["annotations"] = dict(d.annotations)
        dev["containerEdits"] = _edits_to_dict(d.container_edits)
        devices.append(dev)
    out["devices"] = devices
    if not spec.container_edits.is_empty():
        out["containerEdits"] = _edits_to_dict(spec.container_edits)
    return out


def spec_to_json(spec: CdiSpec) -> str:
    return json.dumps(spec_to_dict(spec), indent=2) + "\n"


# --------------------------------------------------------------------------- files (I/O)


def claim_spec_filename(vendor: str, claim_uid: str) -> str:
    """`<vendor>-<class>_<claimUID>.json`, the CDI library's transient-spec naming."""
    validate_vendor(vendor)
    validate_claim_uid(claim_uid)
    return f"{vendor}-{CDI_CLASS}_{claim_uid}{SPEC_EXTENSION}"


def static_spec_filename(vendor: str = DEFAULT_VENDOR) -> str:
    validate_vendor(vendor)
    return f"{vendor}-{CDI_CLASS}{SPEC_EXTENSION}"


def claim_spec_path(cdi_dir: Path, vendor: str, claim_uid: str) -> Path:
    return Path(cdi_dir) / claim_spec_filename(vendor, claim_uid)


def write_spec_file(path: Path, spec: CdiSpec) -> None:
    """Write `spec` to exactly `path`, atomically."""
    write_file_atomic(path, spec_to_json(spec).encode())


def write_spec(cdi_dir: Path, spec: CdiSpec) -> Path:
    """Write `spec` atomically into `cdi_dir` under its standard name (the claim's
    transient name if it has a claim UID, else the static name); returns the path."""
    if spec.claim_uid is not None:
        path = claim_spec_path(cdi_dir, spec.vendor, spec.claim_uid)
    else:
        path = Path(cdi_dir) / static_spec_filename(spec.vendor)
    write_spec_file(path, spec)
    log.debug("CDI spec written", path=str(path), devices=list(spec.qualified_ids()))
    return path


def remove_claim_spec(cdi_dir: Path, vendor: str, claim_uid: str) -> bool:
    """Remove a claim's spec; True if there was one. Removing a missing spec is not an error."""
    path = claim_spec_path(cdi_dir, vendor, claim_uid)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    log.debug("CDI spec removed", path=str(path))
    return True


def claim_uids_in(cdi_dir: Path, vendor: str) -> frozenset[str]:
    """Claim UIDs that have a transient spec of this vendor in `cdi_dir` (for reconciling
    after a crash: specs whose claim is not in the checkpoint are leftovers)."""
    validate_vendor(vendor)
    prefix = f"{vendor}-{CDI_CLASS}_"
    try:
        names = os.listdir(cdi_dir)
    except FileNotFoundError:
        return frozenset()
    uids = set()
    for name in names:
        if name.startswith(prefix) and name.endswith(SPEC_EXTENSION):
            uid = name[len(prefix) : -len(SPEC_EXTENSION)]
            if _CLAIM_UID.fullmatch(uid):
                uids.add(uid)
    return frozenset(uids)
