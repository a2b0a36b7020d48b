"""What a GPU container gets, as CDI container edits and specs (pure builders).

* `build_claim_spec`: one transient spec per claim, one CDI device per allocated device,
  named `<claimUID>-<deviceName>` so a name is never reused (runtimes cache specs);
* `build_static_spec`: one spec for Docker/Podman (`--device <vendor>/gpu=0|<uuid>|all`);
* `device_edits`, `common_edits`: the pieces both are made of; `default_layout`: where
  the driver's files appear inside the container.

What a container gets (the reasoning is in `common_edits`): its own `/dev/nvidiaN` (MIG:
the parent's node plus the two MIG access capability nodes), the control nodes, and the
driver's libraries and tools bind-mounted read-only. No hooks are used, so no NVIDIA
binary needs to be installed on the host for the runtime to call.

It must NOT do I/O (the node's files arrive already scanned as `DriverFiles`; writing is
`dra_driver.cdi.files`) nor know about claims beyond their UID and allocated devices.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from dra_driver.cdi.spec import (
    DEFAULT_VENDOR,
    CdiSpec,
    ContainerEdits,
    Device,
    DeviceNode,
    Mount,
    claim_device_name,
    kind_for,
    validate_device_name,
)
from dra_driver.devices import NodeDevice
from dra_driver.driver_root import DriverFiles
from dra_driver.driver_root.device_nodes import DeviceNodeInfo
from dra_driver.driver_root.user_space import multiarch_triplet
from dra_driver.gpu.model import Inventory

MOUNT_OPTIONS: Final = ("ro", "nosuid", "nodev", "bind")
# Images such as nvidia/cuda set NVIDIA_VISIBLE_DEVICES=all. On a node whose runtime is
# nvidia-container-runtime (legacy or its own CDI mode) that would add every GPU of the
# node on top of the ones this spec grants; "void" makes that runtime leave the container
# alone. Runtimes without the NVIDIA hook ignore the variable.
ISOLATION_ENV: Final = ("NVIDIA_VISIBLE_DEVICES=void",)
DEVICE_ENV_PREFIX: Final = "GPU_DRA_DEVICE_"

_ENV_UNSAFE = re.compile(r"[^A-Z0-9]")


def device_env_name(device_name: str) -> str:
    """Environment variable naming the UUID of an allocated device, e.g. GPU_DRA_DEVICE_GPU_0_UUID.

    Keyed by device name, so the variables of two claims in one container never collide."""
    return f"{DEVICE_ENV_PREFIX}{_ENV_UNSAFE.sub('_', device_name.upper())}_UUID"


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


def _cdi_node(n: DeviceNodeInfo) -> DeviceNode:
    return DeviceNode(
        path=n.path,
        host_path=n.host_path if n.host_path != n.path else None,
        type=n.type,
        major=n.major,
        minor=n.minor,
        file_mode=n.file_mode,
    )


def device_edits(device: NodeDevice, files: DriverFiles) -> ContainerEdits:
    """The edits one device needs on its own: its device nodes and its UUID variable."""
    nodes = [files.gpu_node(device.gpu.minor)]
    if device.mig is not None:
        nodes.extend(
            files.mig_cap_nodes(device.gpu.minor, device.mig.gpu_instance_id, device.mig.compute_instance_id)
        )
    return ContainerEdits(
        env=(f"{device_env_name(device.name)}={device.uuid}",),
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
    devices: Sequence[NodeDevice],
    files: DriverFiles,
    *,
    extra_edits: Mapping[str, ContainerEdits] | None = None,
    layout: ContainerLayout | None = None,
    common: ContainerEdits | None = None,
) -> CdiSpec:
    """The transient spec of one claim: one CDI device `<claimUID>-<device>` per allocated
    device; `extra_edits` (by device name, e.g. sharing settings) are added to that device.
    `common`: `common_edits(files, layout)` made once by a caller that builds many specs."""
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
        container_edits=common if common is not None else common_edits(files, layout),
        claim_uid=claim_uid,
    )


def build_channel_spec(
    vendor: str, claim_uid: str, device_name: str, nodes: Sequence[DeviceNodeInfo]
) -> CdiSpec:
    """The transient spec of an IMEX channel claim: the channel device nodes alone (no GPU, no
    driver files), one CDI device `<claimUID>-<channel device>`."""
    return CdiSpec(
        kind=kind_for(vendor),
        devices=(Device(name=claim_device_name(claim_uid, device_name),
                        container_edits=ContainerEdits(device_nodes=tuple(_cdi_node(n) for n in nodes))),),
        container_edits=ContainerEdits(),
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
        edits = device_edits(NodeDevice(str(gpu.index), gpu), files)
        whole.append(edits)
        devices.append(Device(name=str(gpu.index), container_edits=edits))
        devices.append(Device(name=gpu.uuid, container_edits=edits))
        for mig in gpu.mig_devices:
            name = f"{gpu.index}:{mig.gpu_instance_id}:{mig.compute_instance_id}"
            devices.append(
                Device(name=mig.uuid, container_edits=device_edits(NodeDevice(name, gpu, mig), files))
            )
    if not devices:
        raise ValueError("no GPUs in the inventory: a CDI spec needs at least one device")
    devices.append(Device(name="all", container_edits=_union(whole)))
    for d in devices:
        validate_device_name(d.name)
    return CdiSpec(kind=kind_for(vendor), devices=tuple(devices), container_edits=common_edits(files, layout))
