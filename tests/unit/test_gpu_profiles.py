"""Every shipped profile, discovered through FakeNvml + the real parsing code: facts and topology."""

from __future__ import annotations

import itertools

import pytest

from dra_driver.gpu import discover, load_profile, profile_names
from dra_driver.gpu.model import Inventory, MigDevice
from dra_driver.gpu.topology import LinkVia, NvlinkTopology, nvlink_topology

ALL = tuple(range(8))
PROFILES = (
    "dgx-h100",
    "hgx-h200",
    "dgx1-v100",
    "a100-pcie-bridged",
    "l4x4",
    "a100-mig",
    "gb200-nvl-node",
    "h200-single",
)
CUBE_MESH = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2,
    (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2,
}  # fmt: skip


def topo(name: str) -> tuple[Inventory, NvlinkTopology]:
    inv = discover(name)
    return inv, nvlink_topology(inv)


def assert_groups_are_cliques(t: NvlinkTopology) -> None:
    for size in t.group_sizes:
        for group in t.groups(size):
            assert len(group) == size
            for a, b in itertools.combinations(group, 2):
                assert b in t.gpu(a).peers, f"group {group} of size {size}: {a} and {b} not linked"


def test_the_required_profiles_ship() -> None:
    assert set(PROFILES) <= set(profile_names())


@pytest.mark.parametrize("name", PROFILES)
def test_profile_discovers_with_realistic_facts(name: str) -> None:
    inv, t = topo(name)
    assert inv.source == f"simulated:{name}"
    assert inv.gpus and [g.index for g in inv.gpus] == list(range(len(inv.gpus)))
    for g in inv.gpus:
        assert g.uuid.startswith("GPU-") and len(g.uuid) == 40
        assert g.pci_bus_id == g.pci_bus_id.lower() and len(g.pci_bus_id) == 12
        assert g.memory_bytes > 16 * 1024**3
        assert g.architecture != "Unknown" and g.brand != "Unknown"
    assert_groups_are_cliques(t)


@pytest.mark.parametrize(
    ("name", "product", "cc", "arch", "brand", "memory"),
    [
        ("dgx-h100", "NVIDIA H100 80GB HBM3", "9.0", "Hopper", "Nvidia", 85520809984),
        ("hgx-h200", "NVIDIA H200", "9.0", "Hopper", "Nvidia", 150754820096),
        ("dgx1-v100", "Tesla V100-SXM2-32GB", "7.0", "Volta", "Tesla", 34089205760),
        ("a100-pcie-bridged", "NVIDIA A100 80GB PCIe", "8.0", "Ampere", "Nvidia", 85899345920),
        ("l4x4", "NVIDIA L4", "8.9", "Ada Lovelace", "Nvidia", 24152899584),
        ("a100-mig", "NVIDIA A100-SXM4-40GB", "8.0", "Ampere", "Nvidia", 42505076736),
        ("gb200-nvl-node", "NVIDIA GB200", "10.0", "Blackwell", "Nvidia", 198674743296),
    ],
)
def test_product_facts(name: str, product: str, cc: str, arch: str, brand: str, memory: int) -> None:
    inv = discover(name)
    assert {
        (g.product_name, g.cuda_compute_capability, g.architecture, g.brand, g.memory_bytes) for g in inv.gpus
    } == {(product, cc, arch, brand, memory)}


@pytest.mark.parametrize("name", ["dgx-h100", "hgx-h200"])
def test_nvswitch_box_is_one_group_of_eight(name: str) -> None:
    inv, t = topo(name)
    assert t.groups(8) == (ALL,)
    assert t.groups(4) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert t.groups(2) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert t.islands == (ALL,)
    assert t.cliques == (ALL,)
    for g in t.gpus:
        assert g.peers == tuple(i for i in ALL if i != g.index)
        assert g.group(8) == "nvl8-0-1-2-3-4-5-6-7"
    assert all(link.via is LinkVia.NVSWITCH and link.links == 18 for link in t.links)
    assert len(t.links) == 28
    assert all(g.fabric_clique is None for g in inv.gpus)  # Completed, but no cluster UUID


def test_dgx1_cube_mesh() -> None:
    _, t = topo("dgx1-v100")
    for g in t.gpus:
        assert len(g.peers) == 4
        assert g.peers == tuple(
            sorted({b for a, b in CUBE_MESH if a == g.index} | {a for a, b in CUBE_MESH if b == g.index})
        )
    assert {(p.a, p.b): p.links for p in t.links} == CUBE_MESH
    assert all(p.via is LinkVia.DIRECT for p in t.links)
    assert t.groups(4) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert t.groups(8) == ()
    assert t.gpu(0).group(8) is None
    assert t.groups(2) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert t.islands == (ALL,)
    assert t.cliques == ((0, 1, 2, 3), (4, 5, 6, 7), (0, 4), (1, 5), (2, 6), (3, 7))
    assert t.gpu(0).cliques == ("0-1-2-3", "0-4")


def test_dgx1_links_add_up_to_six_per_gpu() -> None:
    inv, _ = topo("dgx1-v100")
    assert [g.active_nvlinks for g in inv.gpus] == [6] * 8


def test_a100_bridged_pairs_and_no_four_group() -> None:
    _, t = topo("a100-pcie-bridged")
    assert t.group_sizes == (2, 4)
    assert t.groups(2) == ((0, 1), (2, 3))
    assert t.groups(4) == ()
    assert [g.peers for g in t.gpus] == [(1,), (0,), (3,), (2,)]
    assert t.islands == ((0, 1), (2, 3))
    assert [g.island for g in t.gpus] == ["island-0", "island-0", "island-2", "island-2"]
    assert [(p.a, p.b, p.links) for p in t.links] == [(0, 1, 12), (2, 3, 12)]


@pytest.mark.parametrize("name", ["l4x4", "h200-single"])
def test_no_nvlink_no_peers(name: str) -> None:
    inv, t = topo(name)
    assert all(g.peers == () and g.groups == () and g.cliques == () for g in t.gpus)
    assert t.islands == tuple((g.index,) for g in inv.gpus)
    assert t.links == () and t.cliques == ()
    assert all(g.nvlinks == () for g in inv.gpus)  # NVML said NotSupported: nothing invented


def test_h200_single_matches_the_real_host() -> None:
    inv = discover("h200-single")
    (g,) = inv.gpus
    assert (inv.driver_version, inv.cuda_driver_version) == ("580.159.04", "13.0")
    assert g.pci_bus_id == "0000:00:06.0" and g.pcie_root == "pci0000:00"
    assert g.numa_node is None  # NVML NotSupported and sysfs -1
    assert g.minor == 0 and not g.mig_enabled and g.fabric_clique is None
    assert g.multiprocessors is None  # nvmlDeviceGetAttributes is NotSupported on a whole GPU
    assert nvlink_topology(inv).group_sizes == ()


def test_gb200_fabric_clique_and_off_node_switches() -> None:
    inv, t = topo("gb200-nvl-node")
    cliques = {g.fabric_clique for g in inv.gpus}
    assert len(cliques) == 1
    (clique,) = cliques
    assert clique is not None
    assert clique.id == "1f0708a8-1f80-4440-970d-338fe7fee8e1.32766"
    assert t.groups(4) == ((0, 1, 2, 3),)
    assert all(link.remote_pci_bus_id is None for g in inv.gpus for link in g.nvlinks)
    assert [g.pci_bus_id for g in inv.gpus] == [
        "0008:01:00.0",
        "0009:01:00.0",
        "0018:01:00.0",
        "0019:01:00.0",
    ]


def mig(inv: Inventory, gpu: int) -> list[tuple[str, int, int, int, int, int]]:
    def row(m: MigDevice) -> tuple[str, int, int, int, int, int]:
        return (
            m.profile,
            m.gpu_instance_id,
            m.placement_start,
            m.placement_size,
            m.memory_bytes >> 20,
            m.multiprocessors,
        )

    return [row(m) for m in inv.gpu(gpu).mig_devices]


def test_a100_mig_devices() -> None:
    inv = discover("a100-mig")
    assert [g.mig_enabled for g in inv.gpus] == [False] * 4 + [True] * 4
    assert all(inv.gpu(i).mig_devices == () for i in range(4))
    assert mig(inv, 4) == [("7g.40gb", 0, 0, 8, 40448, 98)]
    assert mig(inv, 5) == [("3g.20gb", 1, 0, 4, 20096, 42), ("3g.20gb", 2, 4, 4, 20096, 42)]
    assert mig(inv, 6) == [
        ("2g.10gb", 3, 0, 2, 9984, 28),
        ("1g.5gb", 9, 2, 1, 4864, 14),
        ("1g.5gb", 10, 3, 1, 4864, 14),
        ("3g.20gb", 2, 4, 4, 20096, 42),
    ]
    assert mig(inv, 7) == [
        ("4g.20gb", 1, 0, 4, 20096, 56),
        ("2g.10gb", 5, 4, 2, 9984, 28),
        ("1g.5gb", 13, 6, 1, 4864, 14),
    ]
    seven = inv.gpu(4).mig_devices[0]
    assert (seven.copy_engines, seven.decoders, seven.jpeg_engines, seven.ofa_engines) == (7, 5, 1, 1)
    assert seven.gpu_instance_profile_id == 0 and seven.parent_index == 4
    assert seven.uuid == "MIG-4d128906-fba2-48b6-a13b-2c6abee92941"
    assert inv.gpu(6).mig_devices[1].gpu_instance_profile_id == 19
    assert all(m.compute_instance_id == 0 for g in inv.gpus for m in g.mig_devices)


def test_a100_mig_profile_names_round_trip_the_catalog() -> None:
    """The backend names instances from NVML attributes; they must agree with the catalog names."""
    profile = load_profile("a100-mig")
    inv = discover("a100-mig")
    named = 0
    for spec, g in zip(profile.gpus, inv.gpus, strict=True):
        assert {m.uuid: m.profile.name for m in spec.mig_devices} == {
            m.uuid: m.profile for m in g.mig_devices
        }
        named += len(g.mig_devices)
    assert named == 10


def test_mig_gpus_keep_peers_but_join_no_group() -> None:
    _, t = topo("a100-mig")
    assert t.gpu(6).peers == (0, 1, 2, 3, 4, 5, 7)  # physically on the NVSwitch
    assert t.islands == (ALL,)
    assert t.group_sizes == (2, 4)  # 4 whole GPUs
    assert t.groups(4) == ((0, 1, 2, 3),)
    assert t.groups(2) == ((0, 1), (2, 3))
    assert t.cliques == ((0, 1, 2, 3),)
    assert all(t.gpu(i).groups == () and t.gpu(i).cliques == () for i in range(4, 8))


def test_pcie_paths_from_nvml_topology() -> None:
    inv = discover("dgx1-v100")
    path = inv.gpu(0).path_to(1)
    assert path is not None and path.pcie_level is not None
    assert path.pcie_level.smi_code == "PIX"  # same PLX switch
    far = inv.gpu(0).path_to(5)
    assert far is not None and far.pcie_level is not None and far.pcie_level.smi_code == "SYS"
    assert far.nvlink_p2p is False and path.nvlink_p2p is True
