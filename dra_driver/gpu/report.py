"""The inventory as people and programs read it: a JSON document and a text table.

Pure functions of an `Inventory` and its `NvlinkTopology`; nothing here discovers or
prints, and nothing here knows the slices' attribute names: the caller passes
`layer_name` (layer number -> the attribute that publishes it) to say which attribute
gives each clique. `inventory_document()` is the stable JSON form documented in docs/inventory.md
(`SCHEMA_VERSION` changes only when a key is removed or changes meaning);
`render_table()` is the human form with a connectivity matrix like `nvidia-smi topo -m`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dra_driver.gpu.model import GpuInfo, Inventory, MigDevice, PcieLevel
from dra_driver.gpu.topology import NvlinkTopology

SCHEMA_VERSION = 1
GIB = 1024**3
LayerName = Callable[[int], str]


def _layer(number: int) -> str:
    return f"layer {number}"


def connection(inventory: Inventory, topology: NvlinkTopology, a: int, b: int) -> str:
    """One cell of the matrix: X, NV<links>, NV (P2P only), or the PCIe path code."""
    if a == b:
        return "X"
    link = topology.link(a, b)
    if link is not None:
        return f"NV{link.links}" if link.links is not None else "NV"
    ga, gb = inventory.gpu(a), inventory.gpu(b)
    path = ga.path_to(b) or gb.path_to(a)
    if path is not None and path.pcie_level is not None:
        return path.pcie_level.smi_code
    return _pcie_guess(ga, gb)


def _pcie_guess(a: GpuInfo, b: GpuInfo) -> str:
    """The PCIe relation from sysfs facts when NVML gave no topology level."""
    if a.pcie_root is not None and a.pcie_root == b.pcie_root:
        return PcieLevel.HOSTBRIDGE.smi_code
    if a.numa_node is not None and b.numa_node is not None:
        return PcieLevel.NODE.smi_code if a.numa_node == b.numa_node else PcieLevel.SYSTEM.smi_code
    return "?"


def connectivity_matrix(inventory: Inventory, topology: NvlinkTopology) -> list[list[str]]:
    indexes = [g.index for g in inventory.gpus]
    return [[connection(inventory, topology, a, b) for b in indexes] for a in indexes]


def _mig_document(m: MigDevice) -> dict[str, Any]:
    return {
        "uuid": m.uuid,
        "profile": m.profile,
        "gpuInstanceProfileID": m.gpu_instance_profile_id,
        "gpuInstanceID": m.gpu_instance_id,
        "computeInstanceID": m.compute_instance_id,
        "placement": {"start": m.placement_start, "size": m.placement_size},
        "memory": m.memory_bytes,
        "multiprocessors": m.multiprocessors,
        "copyEngines": m.copy_engines,
        "decoders": m.decoders,
        "encoders": m.encoders,
        "jpegEngines": m.jpeg_engines,
        "ofaEngines": m.ofa_engines,
    }


def _gpu_document(g: GpuInfo, topology: NvlinkTopology) -> dict[str, Any]:
    t = topology.gpu(g.index)
    return {
        "index": g.index,
        "minor": g.minor,
        "uuid": g.uuid,
        "productName": g.product_name,
        "brand": g.brand,
        "architecture": g.architecture,
        "cudaComputeCapability": g.cuda_compute_capability,
        "memory": g.memory_bytes,
        "multiprocessors": g.multiprocessors,
        "pciBusID": g.pci_bus_id,
        "pcieRoot": g.pcie_root,
        "numaNode": g.numa_node,
        "addressingMode": g.addressing_mode,
        "migEnabled": g.mig_enabled,
        "migDevices": [_mig_document(m) for m in g.mig_devices],
        "nvlinkActiveLinks": g.active_nvlinks,
        "nvlinkPeers": list(t.peers),
        "nvlinkIsland": t.island,
        "nvlinkGroups": {str(size): gid for size, gid in t.groups},
        "nvlinkCliques": list(t.cliques),
        "nvlinkLayers": {str(layer): gid for layer, gid in t.layers},
        "nvlinkDomain": t.domain,
        "fabricClique": (
            {
                "clusterUUID": g.fabric_clique.cluster_uuid,
                "cliqueID": g.fabric_clique.clique_id,
                "id": g.fabric_clique.id,
            }
            if g.fabric_clique is not None
            else None
        ),
    }


def _cliques_document(topology: NvlinkTopology, layer_name: LayerName) -> dict[str, Any]:
    layers = topology.clique_layers
    return {
        "layers": [
            {"layer": n, "attribute": layer_name(n), "groups": [list(g) for g in groups]}
            for n, groups in enumerate(layers.layers)
        ],
        "complete": layers.complete,
        "domains": [list(d) for d in topology.domains],
        "coverage": [
            {"size": c.size, "cliques": c.cliques, "covered": c.covered,
             "uncovered": [list(u) for u in c.uncovered]}
            for c in topology.coverage()
        ],
        "exposedBy": [
            {"clique": list(c), "layer": layers.layer_of(c),
             "attribute": None if (n := layers.layer_of(c)) is None else layer_name(n)}
            for c in topology.cliques
        ],
    }


def inventory_document(
    inventory: Inventory, topology: NvlinkTopology, layer_name: LayerName = _layer
) -> dict[str, Any]:
    """The JSON-ready document of docs/inventory.md."""
    return {
        "schemaVersion": SCHEMA_VERSION,
        "source": inventory.source,
        "driverVersion": inventory.driver_version,
        "cudaDriverVersion": inventory.cuda_driver_version,
        "gpus": [_gpu_document(g, topology) for g in inventory.gpus],
        "nvlink": {
            "groupSizes": list(topology.group_sizes),
            "islands": [list(i) for i in topology.islands],
            "cliques": [list(c) for c in topology.cliques],
            "links": [{"gpus": [p.a, p.b], "links": p.links, "via": p.via.value} for p in topology.links],
            "cliqueLayers": _cliques_document(topology, layer_name),
        },
        "connectivity": connectivity_matrix(inventory, topology),
    }


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]
    ]


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _members(clique: tuple[int, ...]) -> str:
    return "{" + ",".join(str(m) for m in clique) + "}"


def render_cliques(topology: NvlinkTopology, layer_name: LayerName = _layer) -> list[str]:
    """What a claim for k NVLink-connected GPUs can get, and which attribute gives each set."""
    layers = topology.clique_layers
    if not topology.cliques:
        return ["NVLink cliques: none (no two whole GPUs are directly linked)"]
    lines = ["NVLink cliques (maximal sets of whole GPUs all linked with each other):"]
    rows = []
    for clique in topology.cliques:
        number = layers.layer_of(clique)
        if number is not None:
            given = f"{layer_name(number)} (layer {number})"
        else:
            parts = [f"{_members(g)} in {layer_name(n)}" for n, groups in enumerate(layers.layers)
                     for g in groups if len(g) >= 2 and set(g) < set(clique)]
            given = "NOT whole: " + (", ".join(parts) if parts else "no layer")
        if clique in topology.domains:
            given += ", nvlinkDomain"
        rows.append([_members(clique), str(len(clique)), given])
    lines += ["  " + line for line in _table(["CLIQUE", "GPUS", "GIVEN BY"], rows)]
    lines += ["", "Linked sets by size (what `count: k` with the documented claim can get):"]
    cov_rows = [[str(c.size), str(c.cliques), str(c.covered),
                 ", ".join(_members(u) for u in c.uncovered) or "-"] for c in topology.coverage()]
    lines += ["  " + line for line in _table(["K", "CLIQUES", "COVERED", "LEFT OUT"], cov_rows)]
    if not layers.complete:
        lines += ["", f"WARNING: {len(layers.layers)} layers cannot hold every clique of this node; "
                      "the sets above marked LEFT OUT cannot be asked for with the GA claim shape "
                      "(the list attribute nvlinkCliques still gives them where it is served)."]
    return lines


def render_table(inventory: Inventory, topology: NvlinkTopology, layer_name: LayerName = _layer) -> str:
    lines = [
        f"GPU inventory ({inventory.source}): {len(inventory.gpus)} GPU(s), "
        f"driver {inventory.driver_version}, CUDA {inventory.cuda_driver_version}",
        "",
    ]
    rows = []
    for g in inventory.gpus:
        t = topology.gpu(g.index)
        rows.append(
            [
                str(g.index),
                g.product_name,
                _gib(g.memory_bytes),
                g.cuda_compute_capability,
                g.pci_bus_id,
                "-" if g.numa_node is None else str(g.numa_node),
                f"{len(g.mig_devices)} dev" if g.mig_enabled else "off",
                ",".join(str(p) for p in t.peers) or "-",
                " ".join(f"{layer_name(n)}={gid}" for n, gid in t.layers) or "-",
            ]
        )
    lines += _table(
        ["GPU", "PRODUCT", "MEMORY", "CC", "PCI", "NUMA", "MIG", "NVLINK PEERS", "CLIQUE LAYERS"], rows
    )

    migs = [m for g in inventory.gpus for m in g.mig_devices]
    if migs:
        lines += ["", "MIG devices:"]
        lines += _table(
            ["GPU", "PROFILE", "GI", "CI", "PLACEMENT", "MEMORY", "SMS", "UUID"],
            [
                [
                    str(m.parent_index),
                    m.profile,
                    str(m.gpu_instance_id),
                    str(m.compute_instance_id),
                    f"{m.placement_start}:{m.placement_size}",
                    _gib(m.memory_bytes),
                    str(m.multiprocessors),
                    m.uuid,
                ]
                for m in migs
            ],
        )

    lines += ["", *render_cliques(topology, layer_name)]

    cliques = [g.fabric_clique.id for g in inventory.gpus if g.fabric_clique is not None]
    if cliques:
        lines += ["", "Fabric cliques: " + ", ".join(sorted(set(cliques)))]

    lines += ["", "Connectivity:"]
    names = [f"GPU{g.index}" for g in inventory.gpus]
    matrix = connectivity_matrix(inventory, topology)
    lines += _table(["", *names], [[name, *row] for name, row in zip(names, matrix, strict=True)])
    lines += [
        "",
        "Legend: X = self, NV# = # NVLink links (NV = NVLink per P2P status, count unknown),",
        "  PIX = one PCIe switch, PXB = several PCIe switches, PHB = same PCIe host bridge,",
        "  NODE = host bridges of one NUMA node, SYS = across NUMA nodes, ? = unknown.",
    ]
    return "\n".join(lines)
