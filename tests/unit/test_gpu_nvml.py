"""The NVML backend: query discipline, unknown-vs-fatal errors, fallbacks, sysfs, naming."""

from __future__ import annotations

import collections
import dataclasses
import os
from pathlib import Path, PurePosixPath
from typing import Any

import pynvml
import pytest

from dra_driver.gpu import nvml
from dra_driver.gpu.errors import GpuDiscoveryError, NvmlUnavailableError
from dra_driver.gpu.model import Inventory, LinkEndpointKind
from dra_driver.gpu.report import connectivity_matrix
from dra_driver.gpu.sim.fake_nvml import FakeNvml, FakeSysfs
from dra_driver.gpu.sim.profile_model import Profile
from dra_driver.gpu.sim.profiles import NVML_ERRORS, load_profile
from dra_driver.gpu.sysfs import HostSysfs, pcie_root_from_path
from dra_driver.gpu.topology import LinkVia, nvlink_topology


def gpu_errors(profile: Profile, **errors: str) -> Profile:
    """The profile with extra failing calls on every GPU."""
    codes = {name: NVML_ERRORS[err] for name, err in errors.items()}
    gpus = tuple(dataclasses.replace(g, errors={**g.errors, **codes}) for g in profile.gpus)
    return dataclasses.replace(profile, gpus=gpus)


def run(profile: Profile) -> tuple[Inventory, FakeNvml]:
    fake = FakeNvml(profile)
    return nvml.discover(fake, FakeSysfs(profile), source="test"), fake


def test_protocol_and_fake_agree() -> None:
    assert "nvmlInit" in nvml.NVML_FUNCTIONS and "nvmlDeviceGetP2PStatus" in nvml.NVML_FUNCTIONS
    fake = FakeNvml(load_profile("h200-single"))
    for name in nvml.NVML_FUNCTIONS:
        assert callable(getattr(fake, name)), name
        assert callable(getattr(pynvml, name)), f"pynvml has no {name}"


@pytest.mark.parametrize("name", ["a100-mig", "dgx1-v100", "gb200-nvl-node", "h200-single"])
def test_one_init_and_every_query_once(name: str) -> None:
    _, fake = run(load_profile(name))
    names = [call for call, _ in fake.calls]
    assert names[0] == "nvmlInit" and names[-1] == "nvmlShutdown"
    assert names.count("nvmlInit") == 1 and names.count("nvmlShutdown") == 1
    repeated = [
        key
        for key, n in collections.Counter(
            (call, tuple(a for a in args if isinstance(a, (int, str)) or dataclasses.is_dataclass(a)))
            for call, args in fake.calls
        ).items()
        if n > 1
    ]
    assert repeated == []


def test_pairwise_queries_once_per_unordered_pair() -> None:
    _, fake = run(load_profile("hgx-h200"))
    names = collections.Counter(call for call, _ in fake.calls)
    assert names["nvmlDeviceGetP2PStatus"] == 28
    assert names["nvmlDeviceGetTopologyCommonAncestor"] == 28


def test_init_failure_is_no_driver() -> None:
    profile = dataclasses.replace(
        load_profile("hgx-h200"), errors={"nvmlInit": pynvml.NVML_ERROR_LIBRARY_NOT_FOUND}
    )
    with pytest.raises(NvmlUnavailableError, match="no usable NVIDIA driver"):
        run(profile)


def test_real_pynvml_without_library_is_no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    with pytest.raises(NvmlUnavailableError, match="LIBRARY_NOT_FOUND"):
        nvml.discover(pynvml)


def test_identity_failure_names_gpu_and_call() -> None:
    profile = load_profile("l4x4")
    gpus = list(profile.gpus)
    gpus[2] = dataclasses.replace(
        gpus[2], errors={**gpus[2].errors, "nvmlDeviceGetUUID": pynvml.NVML_ERROR_GPU_IS_LOST}
    )
    with pytest.raises(GpuDiscoveryError, match=r"nvmlDeviceGetUUID failed for GPU 2: .*GPU_IS_LOST"):
        run(dataclasses.replace(profile, gpus=tuple(gpus)))


def test_optional_facts_unknown_on_any_nvml_error() -> None:
    profile = gpu_errors(
        load_profile("dgx-h100"),
        nvmlDeviceGetNumaNodeId="UNKNOWN",
        nvmlDeviceGetBrand="NOT_SUPPORTED",
        nvmlDeviceGetArchitecture="FUNCTION_NOT_FOUND",
        nvmlDeviceGetTopologyCommonAncestor="NOT_SUPPORTED",
        nvmlDeviceGetMigMode="NOT_SUPPORTED",
    )
    inv, _ = run(profile)
    g = inv.gpu(5)
    # NVML's NUMA failed, so the sysfs answer is used.
    assert (g.numa_node, g.brand, g.architecture, g.mig_enabled) == (1, "Unknown", "Unknown", False)
    assert all(p.pcie_level is None for p in g.peer_paths)


def test_numa_from_sysfs_when_nvml_says_not_supported() -> None:
    profile = load_profile("a100-pcie-bridged")
    gpus = tuple(dataclasses.replace(g, numa_node=None, sysfs_numa_node=g.index % 2) for g in profile.gpus)
    inv, _ = run(dataclasses.replace(profile, gpus=gpus))
    assert [g.numa_node for g in inv.gpus] == [0, 1, 0, 1]


def test_cuda_version_falls_back_to_v1() -> None:
    profile = dataclasses.replace(
        load_profile("l4x4"),
        errors={"nvmlSystemGetCudaDriverVersion_v2": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND},
    )
    inv, fake = run(profile)
    assert inv.cuda_driver_version == "12.8"
    assert ("nvmlSystemGetCudaDriverVersion", ()) in fake.calls


def test_nvlink_remote_kinds() -> None:
    inv, _ = run(load_profile("dgx1-v100"))
    kinds = {link.remote_kind for g in inv.gpus for link in g.nvlinks if link.active}
    assert kinds == {LinkEndpointKind.GPU}
    remote = [link.remote_pci_bus_id for link in inv.gpu(0).nvlinks]
    assert remote == [
        "0000:07:00.0",
        "0000:0a:00.0",
        "0000:0b:00.0",
        "0000:0b:00.0",
        "0000:85:00.0",
        "0000:85:00.0",
    ]
    inv, _ = run(load_profile("hgx-h200"))
    assert {link.remote_kind for link in inv.gpu(0).nvlinks} == {LinkEndpointKind.NVSWITCH}
    assert len(inv.gpu(0).nvlinks) == 18  # link 18+ answered InvalidArgument: left out


def test_old_driver_without_remote_type_still_finds_direct_peers() -> None:
    profile = gpu_errors(
        load_profile("a100-pcie-bridged"), nvmlDeviceGetNvLinkRemoteDeviceType="FUNCTION_NOT_FOUND"
    )
    inv, _ = run(profile)
    assert {link.remote_kind for g in inv.gpus for link in g.nvlinks} == {LinkEndpointKind.UNKNOWN}
    t = nvlink_topology(inv)
    assert t.groups(2) == ((0, 1), (2, 3))
    assert [(p.a, p.b, p.links, p.via) for p in t.links] == [
        (0, 1, 12, LinkVia.DIRECT),
        (2, 3, 12, LinkVia.DIRECT),
    ]


def test_p2p_status_is_the_fallback_when_links_say_nothing() -> None:
    profile = gpu_errors(load_profile("hgx-h200"), nvmlDeviceGetNvLinkState="NOT_SUPPORTED")
    inv, _ = run(profile)
    t = nvlink_topology(inv)
    assert all(g.nvlinks == () for g in inv.gpus)
    assert t.groups(8) == (tuple(range(8)),)
    assert {p.via for p in t.links} == {LinkVia.P2P} and {p.links for p in t.links} == {None}
    assert connectivity_matrix(inv, t)[0][1] == "NV"


def test_p2p_does_not_override_resolved_links() -> None:
    inv, _ = run(load_profile("dgx1-v100"))
    t = nvlink_topology(inv)
    assert t.link(0, 5) is None  # not linked; P2P says no as well, and links were resolved anyway
    assert len(t.links) == 16


def test_unresolvable_switch_links_fall_back_to_p2p() -> None:
    """No remote type and a switch bus id that is no GPU: the links are unresolved, P2P decides."""
    profile = gpu_errors(load_profile("dgx-h100"), nvmlDeviceGetNvLinkRemoteDeviceType="FUNCTION_NOT_FOUND")
    inv, _ = run(profile)
    t = nvlink_topology(inv)
    assert {p.via for p in t.links} == {LinkVia.P2P}
    assert t.groups(8) == (tuple(range(8)),)


def test_fabric_falls_back_to_the_v1_call() -> None:
    profile = gpu_errors(load_profile("gb200-nvl-node"), nvmlDeviceGetGpuFabricInfoV="FUNCTION_NOT_FOUND")
    inv, fake = run(profile)
    assert all(g.fabric_clique is not None and g.fabric_clique.clique_id == 32766 for g in inv.gpus)
    assert sum(1 for call, _ in fake.calls if call == "nvmlDeviceGetGpuFabricInfo") == 4


def test_fabric_not_completed_is_no_clique() -> None:
    profile = load_profile("gb200-nvl-node")
    gpus = tuple(
        dataclasses.replace(
            g, fabric=dataclasses.replace(g.fabric, state=pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS)
        )
        for g in profile.gpus
        if g.fabric is not None
    )
    inv, _ = run(dataclasses.replace(profile, gpus=gpus))
    assert all(g.fabric_clique is None for g in inv.gpus)


def test_different_fabric_clusters_are_not_switch_peers() -> None:
    profile = load_profile("gb200-nvl-node")
    other = bytes(range(16))
    gpus = tuple(
        dataclasses.replace(g, fabric=dataclasses.replace(g.fabric, cluster_uuid=other))
        if g.index >= 2 and g.fabric
        else g
        for g in profile.gpus
    )
    inv, _ = run(dataclasses.replace(profile, gpus=gpus))
    t = nvlink_topology(inv)
    assert t.islands == ((0, 1), (2, 3))
    assert t.groups(4) == ()


def test_mig_failure_is_fatal_and_named() -> None:
    profile = load_profile("a100-mig")
    gpus = list(profile.gpus)
    gpus[6] = dataclasses.replace(gpus[6], errors={"nvmlGpuInstanceGetInfo": pynvml.NVML_ERROR_UNKNOWN})
    with pytest.raises(GpuDiscoveryError, match=r"nvmlGpuInstanceGetInfo failed for GPU 6, MIG slot 0"):
        run(dataclasses.replace(profile, gpus=tuple(gpus)))


@pytest.mark.parametrize(
    ("nvml_id", "sysfs_id"),
    [
        ("00000000:3B:00.0", "0000:3b:00.0"),
        ("00000008:01:00.0", "0008:01:00.0"),
        ("0000:AB:00.1", "0000:ab:00.1"),
    ],
)
def test_normalize_pci_bus_id(nvml_id: str, sysfs_id: str) -> None:
    assert nvml.normalize_pci_bus_id(nvml_id) == sysfs_id


@pytest.mark.parametrize(
    ("version", "text"), [(12080, "12.8"), (13000, "13.0"), (12020, "12.2"), (11040, "11.4")]
)
def test_cuda_version_string(version: int, text: str) -> None:
    assert nvml.cuda_version_string(version) == text


# GPU-instance profiles as a real H200 (driver 580.159.04) reports them, and A100-SXM4-40GB ones.
H200 = 150754820096
A100_40 = 42505076736


@pytest.mark.parametrize(
    ("total", "gi", "ci", "mib", "name"),
    [
        (H200, 1, 1, 16384, "1g.18gb"),
        (H200, 2, 2, 33280, "2g.35gb"),
        (H200, 3, 3, 71424, "3g.71gb"),  # 70.5 rounds half away from zero
        (H200, 4, 4, 71424, "4g.71gb"),
        (H200, 7, 7, 143360, "7g.141gb"),
        (H200, 1, 1, 33280, "1g.35gb"),
        (A100_40, 1, 1, 4864, "1g.5gb"),
        (A100_40, 3, 3, 20096, "3g.20gb"),
        (A100_40, 7, 7, 40448, "7g.40gb"),
        (A100_40, 7, 3, 40448, "3c.7g.40gb"),
    ],
)
def test_mig_profile_names(total: int, gi: int, ci: int, mib: int, name: str) -> None:
    assert nvml.mig_profile_name(gi, ci, nvml.mig_memory_size_gb(total, mib)) == name


def test_pcie_root_from_path() -> None:
    path = PurePosixPath("/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0")
    assert pcie_root_from_path(path) == "pci0000:3a"
    assert pcie_root_from_path(PurePosixPath("/sys/devices/platform/foo")) is None


def make_sysfs(root: Path, bus_id: str, bridge: str, numa: str | None) -> None:
    device = root / "devices" / bridge / f"{bridge[3:]}:00.0" / bus_id
    device.mkdir(parents=True)
    if numa is not None:
        (device / "numa_node").write_text(numa + "\n")
    link_dir = root / "bus" / "pci" / "devices"
    link_dir.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(device, link_dir), link_dir / bus_id)


def test_host_sysfs(tmp_path: Path) -> None:
    make_sysfs(tmp_path, "0000:3b:00.0", "pci0000:3a", "1")
    make_sysfs(tmp_path, "0000:00:06.0", "pci0000:00", "-1")
    make_sysfs(tmp_path, "0008:01:00.0", "pci0008:00", None)
    sysfs = HostSysfs(tmp_path)
    assert (sysfs.pcie_root("0000:3b:00.0"), sysfs.numa_node("0000:3b:00.0")) == ("pci0000:3a", 1)
    assert (sysfs.pcie_root("0000:00:06.0"), sysfs.numa_node("0000:00:06.0")) == ("pci0000:00", None)
    assert (sysfs.pcie_root("0008:01:00.0"), sysfs.numa_node("0008:01:00.0")) == ("pci0008:00", None)
    assert (sysfs.pcie_root("0000:99:00.0"), sysfs.numa_node("0000:99:00.0")) == (None, None)


def test_discover_with_host_sysfs_reads_the_tree(tmp_path: Path) -> None:
    make_sysfs(tmp_path, "0000:00:06.0", "pci0000:00", "-1")
    profile = load_profile("h200-single")
    inv = nvml.discover(FakeNvml(profile), HostSysfs(tmp_path))
    assert (inv.gpus[0].pcie_root, inv.gpus[0].numa_node) == ("pci0000:00", None)


def test_fake_refuses_calls_before_init() -> None:
    fake: Any = FakeNvml(load_profile("l4x4"))
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


def test_a_query_the_fake_does_not_spell_out_answers_from_the_profile_or_not_supported() -> None:
    profile = load_profile("h200-single")
    answers = {"nvmlDeviceGetNumaNodeId": 1, "nvmlDeviceGetMigDeviceHandleByIndex": {0: 7}}
    gpu = dataclasses.replace(profile.gpus[0], nvml=answers, errors={})
    fake = FakeNvml(dataclasses.replace(profile, gpus=(gpu,)))
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    # every query of NvmlApi is spelled out so far: the fallback is called as Python would
    probe = fake.__getattr__("nvmlDeviceGetNumaNodeId")
    assert probe(handle) == 1 and fake.__getattr__("nvmlDeviceGetMigDeviceHandleByIndex")(handle, 0) == 7
    with pytest.raises(pynvml.NVMLError) as missing:
        fake.__getattr__("nvmlDeviceGetMigDeviceHandleByIndex")(handle, 1)
    assert missing.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(AttributeError):
        fake.__getattr__("nvmlSomethingElse")
