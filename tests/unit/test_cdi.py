"""CDI specs: minimum versions, names, the claim and static builders, JSON, and the files."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from dra_driver.cdi.builders import (
    ContainerLayout,
    build_claim_spec,
    build_static_spec,
    common_edits,
    default_layout,
    device_env_name,
)
from dra_driver.cdi.files import (
    claim_spec_filename,
    claim_spec_path,
    claim_uids_in,
    remove_claim_spec,
    spec_to_dict,
    spec_to_json,
    write_spec,
)
from dra_driver.cdi.spec import (
    DEFAULT_VENDOR,
    KNOWN_VERSIONS,
    CdiNameError,
    CdiSpec,
    ContainerEdits,
    Device,
    DeviceNode,
    Hook,
    Mount,
    claim_device_id,
    minimum_version,
    validate_device_name,
    validate_vendor,
)
from dra_driver.devices import NodeDevice
from dra_driver.driver_root import DriverFiles, simulated_driver_files
from dra_driver.driver_root.device_nodes import DeviceNodeInfo, mig_cap_minor
from dra_driver.driver_root.user_space import DriverBinary, DriverLibrary
from dra_driver.gpu.model import GpuInfo, Inventory, MigDevice

Dev = NodeDevice  # short: the specs below name many
UID = "0f3c9a1e-5b7d-4e2a-9c1b-2d3e4f5a6b7c"  # starts with a digit, as many UUIDs do
UID_LETTER = "c3c9a1e0-5b7d-4e2a-9c1b-2d3e4f5a6b7c"
VENDOR = DEFAULT_VENDOR


def gpu(index: int, minor: int | None = None, *, mig: tuple[MigDevice, ...] = ()) -> GpuInfo:
    return GpuInfo(
        index=index,
        minor=index if minor is None else minor,
        uuid=f"GPU-{index:08x}-1111-2222-3333-444455556666",
        product_name="NVIDIA H200",
        brand="Nvidia",
        architecture="Hopper",
        cuda_compute_capability="9.0",
        memory_bytes=150754820096,
        pci_bus_id=f"0000:{index + 0x10:02x}:00.0",
        pcie_root="pci0000:00",
        numa_node=None,
        mig_enabled=bool(mig),
        mig_devices=mig,
    )


def mig_device(parent: int, gi: int, ci: int = 0) -> MigDevice:
    return MigDevice(
        parent_index=parent,
        profile="1g.18gb",
        gpu_instance_id=gi,
        compute_instance_id=ci,
        placement_start=gi,
        placement_size=1,
        uuid=f"MIG-{parent:04x}{gi:04x}-aaaa-bbbb-cccc-dddddddddddd",
        memory_bytes=18 << 30,
        multiprocessors=16,
    )


def node(path: str, major: int, minor: int, host: str | None = None, mode: int = 0o666) -> DeviceNodeInfo:
    return DeviceNodeInfo(path=path, host_path=host or path, major=major, minor=minor, file_mode=mode)


def h200_files(host_dev_root: str = "/dev") -> DriverFiles:
    """What the H200 host's scan finds (reference/h200-host.md)."""
    return DriverFiles(
        driver_root="/usr/local/nvidia",
        control_nodes=(
            node("/dev/nvidiactl", 195, 255),
            node("/dev/nvidia-uvm", 238, 0),
            node("/dev/nvidia-uvm-tools", 238, 1),
        ),
        gpu_nodes=(node("/dev/nvidia0", 195, 0), node("/dev/nvidia3", 195, 3)),
        caps_nodes=(node("/dev/nvidia-caps/nvidia-cap1", 241, 1, mode=0o400),),
        libraries=(
            DriverLibrary(
                "/usr/local/nvidia/lib64/libcuda.so.580.159.04",
                ("libcuda.so", "libcuda.so.1", "libcuda.so.580.159.04"),
            ),
            DriverLibrary(
                "/usr/local/nvidia/lib64/libnvidia-ml.so.580.159.04",
                ("libnvidia-ml.so.1", "libnvidia-ml.so.580.159.04"),
            ),
        ),
        binaries=(DriverBinary("/usr/local/nvidia/bin/nvidia-smi", "nvidia-smi"),),
        firmware_dir="/usr/local/nvidia/firmware/nvidia/580.159.04",
        driver_version="580.159.04",
        caps_major=241,
        host_dev_root=host_dev_root,
    )


LAYOUT = ContainerLayout(lib_dirs=("/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64"))


def edits(**kw: object) -> ContainerEdits:
    return ContainerEdits(**kw)  # type: ignore[arg-type]


def spec_with(
    device_name: str = "gpu-0",
    edits_: ContainerEdits | None = None,
    kind: str = f"{VENDOR}/gpu",
    **kw: object,
) -> CdiSpec:
    return CdiSpec(kind=kind, devices=(Device(device_name, edits_ or ContainerEdits()),), **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- minimum version


def test_plain_env_nodes_and_mounts_need_0_3_0() -> None:
    e = edits(
        env=("A=1",),
        device_nodes=(DeviceNode("/dev/nvidia0", type="c", major=195, minor=0),),
        mounts=(Mount("/a", "/b", ("ro", "bind")),),
    )
    assert minimum_version(spec_with(edits_=e)) == "0.3.0"


def test_mount_type_needs_0_4_0() -> None:
    assert (
        minimum_version(spec_with(edits_=edits(mounts=(Mount("/a", "/b", type="bind"),)))) == "0.4.0"
    )


def test_device_node_host_path_needs_0_5_0() -> None:
    e = edits(device_nodes=(DeviceNode("/dev/nvidia0", host_path="/host/dev/nvidia0"),))
    assert minimum_version(spec_with(edits_=e)) == "0.5.0"


def test_host_path_in_spec_level_edits_counts_too() -> None:
    s = CdiSpec(
        kind=f"{VENDOR}/gpu",
        devices=(Device("gpu-0", ContainerEdits()),),
        container_edits=edits(device_nodes=(DeviceNode("/dev/nvidiactl", host_path="/h/nvidiactl"),)),
    )
    assert minimum_version(s) == "0.5.0"


def test_device_name_starting_with_a_digit_needs_0_5_0() -> None:
    assert minimum_version(spec_with(device_name="0")) == "0.5.0"
    assert minimum_version(spec_with(device_name="gpu0")) == "0.3.0"


def test_annotations_need_0_6_0() -> None:
    assert minimum_version(spec_with(annotations=(("a", "b"),))) == "0.6.0"
    dev = Device("gpu-0", ContainerEdits(), annotations=(("a", "b"),))
    assert minimum_version(CdiSpec(kind=f"{VENDOR}/gpu", devices=(dev,))) == "0.6.0"


def test_dot_in_class_needs_0_6_0_but_dot_in_vendor_does_not() -> None:
    assert minimum_version(spec_with(kind="a.b/c.d")) == "0.6.0"
    assert minimum_version(spec_with(kind="a.b/cd")) == "0.3.0"


def test_additional_gids_need_0_7_0() -> None:
    assert minimum_version(spec_with(edits_=edits(additional_gids=(44,)))) == "0.7.0"


def test_the_newest_feature_decides() -> None:
    e = edits(mounts=(Mount("/a", "/b", type="bind"),), additional_gids=(44,))
    assert minimum_version(spec_with(device_name="0", edits_=e)) == "0.7.0"


def test_versions_written_are_known_to_the_cdi_library() -> None:
    assert {"0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0"} <= set(KNOWN_VERSIONS)


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize("vendor", ["gpu.dra-driver.dev", "example.com", "a"])
def test_valid_vendors(vendor: str) -> None:
    validate_vendor(vendor)


@pytest.mark.parametrize(
    "vendor",
    [
        "",
        "Gpu.example.com",
        "gpu_x.example.com",
        "-gpu.example.com",
        "gpu.example.com.",
        "1gpu.example.com",
        "a..b",
    ],
)
def test_invalid_vendors(vendor: str) -> None:
    with pytest.raises(CdiNameError):
        validate_vendor(vendor)


@pytest.mark.parametrize("name", ["gpu-0", f"{UID}-gpu-0", "0", "GPU-abc", "a:b.c_d"])
def test_valid_device_names(name: str) -> None:
    validate_device_name(name)


@pytest.mark.parametrize("name", ["", "-gpu", "gpu-", "gpu/0", "gpu 0", "gpu=0", "gpü"])
def test_invalid_device_names(name: str) -> None:
    with pytest.raises(CdiNameError):
        validate_device_name(name)


def test_claim_device_id_format() -> None:
    device_id = claim_device_id(VENDOR, UID, "gpu-0")
    assert device_id == f"gpu.dra-driver.dev/gpu={UID}-gpu-0"


@pytest.mark.parametrize("uid", ["../../etc", "a/b", "", "x" * 129, "uid with space"])
def test_claim_uids_that_cannot_name_a_file_are_refused(uid: str) -> None:
    with pytest.raises(CdiNameError):
        claim_spec_filename(VENDOR, uid)


def test_device_env_name_is_a_valid_variable_name() -> None:
    assert device_env_name("gpu-0") == "GPU_DRA_DEVICE_GPU_0_UUID"
    assert device_env_name("gpu-1-mig-1g18gb-3") == "GPU_DRA_DEVICE_GPU_1_MIG_1G18GB_3_UUID"


# --------------------------------------------------------------------------- claim spec


def test_claim_spec_one_device_per_allocation_with_its_own_node() -> None:
    g0, g1 = gpu(0), gpu(1, minor=3)  # index and minor differ on purpose
    spec = build_claim_spec(
        VENDOR, UID, [Dev("gpu-0", g0), Dev("gpu-1", g1)], h200_files(), layout=LAYOUT
    )
    assert spec.kind == "gpu.dra-driver.dev/gpu"
    assert spec.qualified_ids() == (f"{VENDOR}/gpu={UID}-gpu-0", f"{VENDOR}/gpu={UID}-gpu-1")
    d0, d1 = spec.devices
    assert [(n.path, n.major, n.minor, n.type) for n in d0.container_edits.device_nodes] == [
        ("/dev/nvidia0", 195, 0, "c")
    ]
    assert [n.path for n in d1.container_edits.device_nodes] == ["/dev/nvidia3"]
    assert d0.container_edits.env == (f"GPU_DRA_DEVICE_GPU_0_UUID={g0.uuid}",)
    assert d1.container_edits.env == (f"GPU_DRA_DEVICE_GPU_1_UUID={g1.uuid}",)
    assert d0.container_edits.mounts == ()  # shared edits live at spec level


def test_claim_spec_level_edits_hold_control_nodes_driver_files_and_isolation_env() -> None:
    spec = build_claim_spec(VENDOR, UID, [Dev("gpu-0", gpu(0))], h200_files(), layout=LAYOUT)
    common = spec.container_edits
    assert [n.path for n in common.device_nodes] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]
    assert common.env == ("NVIDIA_VISIBLE_DEVICES=void",)
    assert not any(e.startswith(("LD_LIBRARY_PATH=", "CUDA_VISIBLE_DEVICES=")) for e in common.env)
    targets = {m.container_path: m for m in common.mounts}
    real = "/usr/local/nvidia/lib64/libcuda.so.580.159.04"
    for d in LAYOUT.lib_dirs:
        for name in ("libcuda.so", "libcuda.so.1", "libcuda.so.580.159.04"):
            assert targets[f"{d}/{name}"].host_path == real
    assert targets["/usr/bin/nvidia-smi"].host_path == "/usr/local/nvidia/bin/nvidia-smi"
    assert len(common.mounts) == 3 * (3 + 2) + 1
    assert all(m.options == ("ro", "nosuid", "nodev", "bind") and m.type is None for m in common.mounts)


def test_mig_device_gets_parent_node_and_its_two_access_caps() -> None:
    m = mig_device(parent=1, gi=2, ci=0)
    parent = gpu(1, minor=3, mig=(m,))
    spec = build_claim_spec(
        VENDOR, UID, [Dev("gpu-1-mig-1g18gb-2", parent, m)], h200_files(), layout=LAYOUT
    )
    (d,) = spec.devices
    gi, ci = mig_cap_minor(3, 2, None), mig_cap_minor(3, 2, 0)
    assert [(n.path, n.major, n.minor) for n in d.container_edits.device_nodes] == [
        ("/dev/nvidia3", 195, 3),
        (f"/dev/nvidia-caps/nvidia-cap{gi}", 241, gi),
        (f"/dev/nvidia-caps/nvidia-cap{ci}", 241, ci),
    ]
    assert d.container_edits.env == (f"GPU_DRA_DEVICE_GPU_1_MIG_1G18GB_2_UUID={m.uuid}",)


def test_cdi_version_of_claim_specs() -> None:
    files = h200_files()
    assert build_claim_spec(VENDOR, UID_LETTER, [Dev("gpu-0", gpu(0))], files).cdi_version == "0.3.0"
    assert build_claim_spec(VENDOR, UID, [Dev("gpu-0", gpu(0))], files).cdi_version == "0.5.0"


def test_host_path_written_only_when_the_host_dev_root_differs() -> None:
    same = build_claim_spec(VENDOR, UID_LETTER, [Dev("gpu-0", gpu(0))], h200_files())
    assert all(n.host_path is None for n in same.devices[0].container_edits.device_nodes)
    moved = build_claim_spec(
        VENDOR,
        UID_LETTER,
        [Dev("gpu-0", gpu(0))],
        simulated_driver_files([0], host_dev_root="/host/dev", proc_root="/nonexistent"),
    )
    (n,) = moved.devices[0].container_edits.device_nodes
    assert (n.path, n.host_path) == ("/dev/nvidia0", "/host/dev/nvidia0")
    assert moved.cdi_version == "0.5.0"


def test_extra_edits_are_added_to_their_device_only() -> None:
    mps = edits(
        env=("CUDA_MPS_PIPE_DIRECTORY=/mps",), mounts=(Mount("/run/mps/x", "/mps", ("rw", "bind")),)
    )
    spec = build_claim_spec(
        VENDOR, UID, [Dev("gpu-0", gpu(0)), Dev("gpu-1", gpu(1))], h200_files(), extra_edits={"gpu-1": mps}
    )
    d0, d1 = spec.devices
    assert "CUDA_MPS_PIPE_DIRECTORY=/mps" in d1.container_edits.env
    assert d1.container_edits.env[0].startswith("GPU_DRA_DEVICE_GPU_1_UUID=")
    assert d1.container_edits.mounts == mps.mounts
    assert d0.container_edits.mounts == () and len(d0.container_edits.env) == 1


@pytest.mark.parametrize(
    ("devices", "extra", "message"),
    [
        ([], None, "at least one device"),
        ([Dev("gpu-0", gpu(0)), Dev("gpu-0", gpu(0))], None, "twice"),
        ([Dev("gpu-0", gpu(0))], {"gpu-9": ContainerEdits()}, "not in the claim"),
    ],
)
def test_claim_spec_refuses_inconsistent_input(
    devices: list[Dev], extra: dict[str, ContainerEdits] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_claim_spec(VENDOR, UID, devices, h200_files(), extra_edits=extra)


def test_claim_spec_refuses_a_bad_vendor() -> None:
    with pytest.raises(CdiNameError):
        build_claim_spec("Not_A_DNS_Name", UID, [Dev("gpu-0", gpu(0))], h200_files())


def test_default_layout_lists_cuda_image_dir_and_loader_default_dirs() -> None:
    assert default_layout("x86_64").lib_dirs == (
        "/usr/local/nvidia/lib64",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
    )
    assert default_layout("aarch64").lib_dirs[1] == "/usr/lib/aarch64-linux-gnu"


# --------------------------------------------------------------------------- static spec


def test_static_spec_by_index_uuid_and_all() -> None:
    m = mig_device(parent=1, gi=1)
    inv = Inventory(driver_version="580.159.04", cuda_driver_version="13.0", gpus=(gpu(1, mig=(m,)), gpu(0)))
    spec = build_static_spec(inv, h200_files(), VENDOR)
    names = [d.name for d in spec.devices]
    assert names == ["0", gpu(0).uuid, "1", gpu(1).uuid, m.uuid, "all"]
    by = {d.name: d for d in spec.devices}
    assert by["0"].container_edits == by[gpu(0).uuid].container_edits
    assert [n.path for n in by["all"].container_edits.device_nodes] == ["/dev/nvidia0", "/dev/nvidia1"]
    mig_nodes = [n.path for n in by[m.uuid].container_edits.device_nodes]
    assert mig_nodes[0] == "/dev/nvidia1" and len(mig_nodes) == 3
    assert spec.cdi_version == "0.5.0"  # device names start with digits
    assert spec.claim_uid is None


def test_static_spec_needs_a_gpu() -> None:
    with pytest.raises(ValueError, match="no GPUs"):
        build_static_spec(Inventory("580", "13.0", ()), h200_files())


# --------------------------------------------------------------------------- JSON


def test_json_uses_cdi_key_names() -> None:
    e = edits(
        env=("A=1",),
        device_nodes=(
            DeviceNode(
                "/dev/x",
                host_path="/h/x",
                type="c",
                major=1,
                minor=0,
                file_mode=0o666,
                permissions="rw",
                uid=0,
                gid=5,
            ),
        ),
        mounts=(Mount("/a", "/b", ("ro",), type="bind"),),
        hooks=(Hook("createContainer", "/bin/true", ("true",), timeout=5),),
        additional_gids=(44,),
    )
    doc = spec_to_dict(spec_with(edits_=e))
    assert list(doc) == ["cdiVersion", "kind", "devices"]
    assert doc["cdiVersion"] == "0.7.0"
    ce = doc["devices"][0]["containerEdits"]
    assert set(ce) == {"env", "deviceNodes", "mounts", "hooks", "additionalGids"}
    assert ce["deviceNodes"][0] == {
        "path": "/dev/x",
        "hostPath": "/h/x",
        "type": "c",
        "major": 1,
        "minor": 0,
        "fileMode": 438,
        "permissions": "rw",
        "uid": 0,
        "gid": 5,
    }
    assert ce["mounts"][0] == {"hostPath": "/a", "containerPath": "/b", "options": ["ro"], "type": "bind"}
    assert ce["hooks"][0] == {
        "hookName": "createContainer",
        "path": "/bin/true",
        "args": ["true"],
        "timeout": 5,
    }
    assert ce["additionalGids"] == [44]


def test_json_omits_unset_fields_but_always_has_device_container_edits() -> None:
    doc = spec_to_dict(spec_with(edits_=edits(device_nodes=(DeviceNode("/dev/x"),))))
    assert doc["devices"][0]["containerEdits"] == {"deviceNodes": [{"path": "/dev/x"}]}
    assert "containerEdits" not in doc
    assert spec_to_dict(spec_with())["devices"][0]["containerEdits"] == {}


def test_spec_json_is_the_dict() -> None:
    spec = build_claim_spec(VENDOR, UID, [Dev("gpu-0", gpu(0))], h200_files())
    assert json.loads(spec_to_json(spec)) == spec_to_dict(spec)


def test_spec_json_is_json_dumps_of_the_dict_byte_for_byte() -> None:
    """The file's text is exactly what json.dumps of the whole object writes, with shared
    spec-level edits, an equal copy of them, and none."""
    files = h200_files()
    common = common_edits(files)
    specs = [
        build_claim_spec(VENDOR, UID, [Dev("gpu-0", gpu(0))], files, common=common),
        build_claim_spec(VENDOR, "other-uid", [Dev("gpu-1", gpu(1))], files, common=common),  # shared again
        build_claim_spec(VENDOR, UID, [Dev("gpu-0", gpu(0))], files),  # an equal object, not the same
        spec_with(annotations=(("a", "b"),)),  # no spec-level edits: the key is left out
        spec_with(edits_=edits(env=("A=1",)), container_edits=edits(mounts=(Mount("/h", "/c"),))),
    ]
    for spec in specs:
        assert spec_to_json(spec) == json.dumps(spec_to_dict(spec)) + "\n"


# --------------------------------------------------------------------------- files


def claim_spec(uid: str = UID, vendor: str = VENDOR) -> CdiSpec:
    return build_claim_spec(vendor, uid, [Dev("gpu-0", gpu(0))], h200_files())


def test_write_spec_names_the_file_after_the_claim(tmp_path: Path) -> None:
    path = write_spec(tmp_path / "cdi", claim_spec())
    assert path == tmp_path / "cdi" / f"gpu.dra-driver.dev-gpu_{UID}.json"
    assert path == claim_spec_path(tmp_path / "cdi", VENDOR, UID)
    assert json.loads(path.read_text()) == spec_to_dict(claim_spec())
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert os.listdir(tmp_path / "cdi") == [path.name]  # no temp file left


def test_static_spec_file_name(tmp_path: Path) -> None:
    inv = Inventory("580", "13.0", (gpu(0),))
    path = write_spec(tmp_path, build_static_spec(inv, h200_files()))
    assert path.name == "gpu.dra-driver.dev-gpu.json"


def test_remove_is_idempotent(tmp_path: Path) -> None:
    write_spec(tmp_path, claim_spec())
    assert remove_claim_spec(tmp_path, VENDOR, UID) is True
    assert remove_claim_spec(tmp_path, VENDOR, UID) is False
    assert remove_claim_spec(tmp_path / "missing-dir", VENDOR, UID) is False
    assert os.listdir(tmp_path) == []


def test_claim_uids_in_lists_only_this_vendors_claim_specs(tmp_path: Path) -> None:
    write_spec(tmp_path, claim_spec(UID))
    write_spec(tmp_path, claim_spec(UID_LETTER))
    write_spec(tmp_path, claim_spec("other-claim", vendor="other.example.com"))
    write_spec(tmp_path, build_static_spec(Inventory("580", "13.0", (gpu(0),)), h200_files()))
    (tmp_path / f".gpu.dra-driver.dev-gpu_{UID}.json.1234.tmp").write_text("{")  # a crash's leftover
    (tmp_path / "k8s.gpu.nvidia.com-claim_abc.yaml").write_text("")
    assert claim_uids_in(tmp_path, VENDOR) == {UID, UID_LETTER}
    assert claim_uids_in(tmp_path / "missing", VENDOR) == frozenset()


def test_failed_rename_keeps_the_old_spec_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = build_claim_spec(VENDOR, UID, [Dev("gpu-0", gpu(0))], h200_files())
    new = build_claim_spec(VENDOR, UID, [Dev("gpu-0", gpu(0)), Dev("gpu-1", gpu(1))], h200_files())
    path = write_spec(tmp_path, old)

    def crash(*_: object) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        write_spec(tmp_path, new)
    assert json.loads(path.read_text()) == spec_to_dict(old)
    assert os.listdir(tmp_path) == [path.name]


# --------------------------------------------------------------------------- the real CDI library


def _cdicheck() -> str | None:
    candidates = [os.environ.get("CDICHECK", ""), shutil.which("cdicheck") or ""]
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    candidates += sorted(glob.glob(f"{cache}/gpu-dra-driver/cluster/*/cdicheck"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@pytest.mark.skipif(
    _cdicheck() is None, reason="cdicheck not built (hack/cluster/build.sh) and $CDICHECK unset"
)
def test_the_cdi_library_loads_and_injects_our_specs(tmp_path: Path) -> None:
    m = mig_device(parent=1, gi=2)
    inv = Inventory("580.159.04", "13.0", (gpu(0), gpu(1, mig=(m,))))
    files = simulated_driver_files([0, 1], host_dev_root="/host/dev")
    write_spec(
        tmp_path, build_claim_spec(VENDOR, UID, [Dev("gpu-0", gpu(0)), Dev("mig", gpu(1), m)], files)
    )
    write_spec(tmp_path, build_static_spec(inv, h200_files()))
    ids = [
        claim_device_id(VENDOR, UID, "gpu-0"),
        claim_device_id(VENDOR, UID, "mig"),
        f"{VENDOR}/gpu=all",
    ]
    out = subprocess.run(
        [str(_cdicheck()), "-dir", str(tmp_path), *ids],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    oci = json.loads(out.stdout)
    paths = {d["path"] for d in oci["linux"]["devices"]}
    assert {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"} <= paths
    assert f"/dev/nvidia-caps/nvidia-cap{mig_cap_minor(1, 2, 0)}" in paths
    assert "NVIDIA_VISIBLE_DEVICES=void" in oci["process"]["env"]
    assert any(mt["destination"] == "/usr/lib64/libcuda.so.1" for mt in oci["mounts"])


# --------------------------------------------------------------------------- `dra-driver cdi generate`


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[Inventory]:
    import dra_driver.gpu

    inv = Inventory("580.159.04", "13.0", (gpu(0), gpu(1)), source="simulated:test")
    seen: list[str | None] = []

    def fake_discover(simulate: str | None = None) -> Inventory:
        seen.append(simulate)
        return inv

    monkeypatch.setattr(dra_driver.gpu, "discover", fake_discover)
    # Unconfigured structlog prints to stdout; `dra-driver` itself logs to stderr.
    with structlog.testing.capture_logs():
        yield inv


def test_generate_prints_the_static_spec(two_gpus: Inventory) -> None:
    from click.testing import CliRunner

    from dra_driver.commands.cdi import cdi as cdi_group

    result = CliRunner().invoke(
        cdi_group, ["generate", "--simulate", "test", "--driver-name", "gpus.example.com"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["kind"] == "gpus.example.com/gpu"
    assert [d["name"] for d in doc["devices"]] == ["0", gpu(0).uuid, "1", gpu(1).uuid, "all"]
    assert "mounts" not in doc["containerEdits"]  # simulated, no driver root: nothing to mount
    assert doc["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 438}
    ]


def test_generate_writes_the_file(two_gpus: Inventory, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from dra_driver.commands.cdi import cdi as cdi_group

    out = tmp_path / "etc-cdi" / "gpu.dra-driver.dev-gpu.json"
    result = CliRunner().invoke(cdi_group, ["generate", "--simulate", "test", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["kind"] == "gpu.dra-driver.dev/gpu"


def test_generate_refuses_a_bad_driver_name(two_gpus: Inventory) -> None:
    from click.testing import CliRunner

    from dra_driver.commands.cdi import cdi as cdi_group

    result = CliRunner().invoke(cdi_group, ["generate", "--simulate", "x", "--driver-name", "Bad_Name"])
    assert result.exit_code == 2
    assert "DNS subdomain" in result.output
