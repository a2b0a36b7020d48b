"""The attribute vocabulary as a table: what docs/attributes.md shows for each attribute and capacity.

`VOCABULARY` and `CAPACITIES` are the single source of that table (`markdown_table()` renders
it; a test keeps the two equal); the rows of the attributes read straight from the inventory
are those of `controller.attributes.FACTS`, written beside their values. Pure data: it must not
decide what a device publishes (controller/attributes.py does).
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.attributes import (
    COPY_ENGINES,
    DECODERS,
    ENCODERS,
    FABRIC_CLIQUE_ID,
    FACTS,
    INDEX,
    ISOLATION,
    JPEG_ENGINES,
    MEMORY,
    MEMORY_SLICE_PREFIX,
    MIG_ENABLED,
    MINOR,
    MULTIPROCESSORS,
    NUMA_NODE,
    NVLINK_CLIQUE_SIZE,
    NVLINK_CLIQUES,
    NVLINK_DOMAIN,
    NVLINK_GROUP_PREFIX,
    NVLINK_GROUP_SIZES,
    NVLINK_ISLAND,
    NVLINK_LAYER_PREFIX,
    NVLINK_LAYERS,
    NVLINK_PEER_COUNT,
    NVLINK_PEERS,
    OFA_ENGINES,
    PARENT_INDEX,
    PARENT_UUID,
    PROFILE,
    TYPE,
    UUID,
    nvlink_group_attribute,
)


@dataclass(frozen=True)
class AttributeDoc:
    """One row of the vocabulary table."""

    name: str
    type: str  # the DeviceAttribute field: string, int, bool, version, ints, strings
    example: str
    meaning: str
    nvidia: str  # whether/how NVIDIA's gpu.nvidia.com driver publishes it
    devices: str  # "gpu", "mig" or "gpu, mig"


_BOTH = "gpu, mig"

VOCABULARY: tuple[AttributeDoc, ...] = (
    AttributeDoc(TYPE, "string", '"gpu"', 'kind of device: "gpu" (whole GPU) or "mig" (MIG instance)',
                 "yes", _BOTH),
    AttributeDoc(UUID, "string", '"GPU-5b1c…" / "MIG-…"', "NVML UUID of the device", "yes", _BOTH),
    *(AttributeDoc(f.name, f.type, f.example, f.meaning, f.nvidia, f.devices) for f in FACTS),
    AttributeDoc(PARENT_UUID, "string", '"GPU-5b1c…"', "UUID of the MIG instance's GPU", "yes", "mig"),
    AttributeDoc(PROFILE, "string", '"1g.10gb"', "MIG profile", "yes", "mig"),
    AttributeDoc(INDEX, "int", "3", "NVML index of the GPU", "v25.3 only", "gpu"),
    AttributeDoc(MINOR, "int", "3", "device minor: `/dev/nvidia<minor>`", "v25.3 only", "gpu"),
    AttributeDoc(PARENT_INDEX, "int", "3", "NVML index of the MIG instance's GPU", "v25.3 only", "mig"),
    AttributeDoc(NUMA_NODE, "int", "0", "legacy, opt-in (`--legacy-attributes`): NUMA node, only when "
                 "known; repeats resource.kubernetes.io/numaNode", "no", _BOTH),
    AttributeDoc(NVLINK_PEER_COUNT, "int", "4",
                 "opt-in (`--topology-detail-attributes`): how many other GPUs of the node this GPU has "
                 "NVLink to (GPUs in MIG mode included)",
                 "no", "gpu"),
    AttributeDoc(NVLINK_PEERS, "string (ints with list attributes)", '"1,2,3,6" / [1, 2, 3, 6]',
                 "opt-in (`--topology-detail-attributes`): indexes of the NVLink peers, ascending (as "
                 "ranges, \"0-4,6-63\", past 64 chars); absent with no peers", "no", "gpu"),
    AttributeDoc(NVLINK_ISLAND, "string", '"island-0"',
                 "opt-in (`--topology-detail-attributes`): GPUs with the same value are connected by "
                 "NVLink paths, possibly over other GPUs: reachable, NOT necessarily linked with each "
                 "other (use nvlinkClique<L> for that)",
                 "no", "gpu"),
    AttributeDoc(f"{NVLINK_LAYER_PREFIX}<L>", "string", '"0-1-2"',
                 f"clique layer L (0 to {NVLINK_LAYERS - 1}): GPUs with the same value are all directly "
                 "linked with each other; the groups of one layer are disjoint and together the layers "
                 "hold every maximal clique of the node (docs/nvlink.md); use one per firstAvailable "
                 "subrequest", "no", "gpu"),
    AttributeDoc(NVLINK_DOMAIN, "string", '"island-0"',
                 "the GPU's NVLink island, only where every whole GPU of the island is linked to every "
                 "other (NVSwitch): `matchAttribute` on it gives any k of them", "no", "gpu"),
    AttributeDoc(NVLINK_CLIQUE_SIZE, "int", "4",
                 "size of the largest set of mutually linked whole GPUs this GPU is in (1 with no "
                 "peer): the selector `>= k` of the NVLink claims drops a GPU, and a node, that can "
                 "never give k linked GPUs before any `matchAttribute` search", "no", "gpu"),
    AttributeDoc(NVLINK_CLIQUES, "strings (list attributes only)", '["0-1-2-3", "0-4"]',
                 "ids of the maximal sets of mutually linked GPUs this GPU belongs to; `matchAttribute` "
                 "on it (list semantics: the chosen GPUs share one value) gives k linked GPUs",
                 "no", "gpu"),
    AttributeDoc(nvlink_group_attribute(2), "string", '"nvl2-0-1"',
                 "legacy, opt-in (`--legacy-attributes`), fragments: ONE fixed partition into mutually "
                 "linked pairs (a GPU may have none, and linked pairs across two groups are never "
                 "offered); kept for older claims",
                 "no", "gpu"),
    AttributeDoc(nvlink_group_attribute(4), "string", '"nvl4-0-1-2-3"',
                 "legacy, fragments: same, one fixed partition into groups of 4", "no", "gpu"),
    AttributeDoc(nvlink_group_attribute(8), "string", '"nvl8-0-1-2-3-4-5-6-7"',
                 "legacy, fragments: same, groups of 8", "no", "gpu"),
    AttributeDoc(f"{NVLINK_GROUP_PREFIX}<N>", "string", '"nvl16-0-1-…-15"',
                 f"legacy, same, for N in {', '.join(str(n) for n in NVLINK_GROUP_SIZES[3:])}", "no", "gpu"),
    AttributeDoc(FABRIC_CLIQUE_ID, "string", '"8c1f…-…-….7"',
                 "multi-node NVLink fabric clique `<clusterUUID>.<cliqueId>` (NVIDIA's node label "
                 "`nvidia.com/gpu.clique`), only in a fabric", "label only", "gpu"),
    AttributeDoc(MIG_ENABLED, "bool", "true",
                 "only on a whole GPU in MIG mode (published with `--dynamic-mig`): CUDA sees no usable "
                 "device in it as a whole, so the whole-GPU class never selects it; absent otherwise",
                 "before v25.3 (always, true or false)", "gpu"),
    AttributeDoc(ISOLATION, "string", '"cooperative"',
                 "on memory-share views only: the share's memory limit holds for processes that use its MPS "
                 "daemon, not for one that steps around MPS (docs/sharing.md, \"What a share isolates\"); "
                 'select `!= "cooperative"` to keep a workload off shares', "no", "gpu-share"),
)


@dataclass(frozen=True)
class CapacityDoc:
    """One row of the capacity table."""

    name: str
    example: str
    meaning: str
    nvidia: str
    devices: str


CAPACITIES: tuple[CapacityDoc, ...] = (
    CapacityDoc(MEMORY, '"81559Mi"', "framebuffer memory in bytes (canonical binary quantity)", "yes", _BOTH),
    CapacityDoc(MULTIPROCESSORS, '"132"', "streaming multiprocessors; on whole GPUs only when known",
                "mig (gpu: DynamicMIG only)", _BOTH),
    CapacityDoc(COPY_ENGINES, '"1"', "copy engines of the instance", "yes", "mig"),
    CapacityDoc(DECODERS, '"1"', "video decoders of the instance", "yes", "mig"),
    CapacityDoc(ENCODERS, '"0"', "video encoders of the instance", "yes", "mig"),
    CapacityDoc(JPEG_ENGINES, '"1"', "JPEG engines of the instance", "yes", "mig"),
    CapacityDoc(OFA_ENGINES, '"0"', "optical-flow engines of the instance", "yes", "mig"),
    CapacityDoc(f"{MEMORY_SLICE_PREFIX}<i>", '"1"', "1 for each memory slice the instance occupies",
                "yes", "mig"),
)


def markdown_table() -> str:
    """The vocabulary as the Markdown table of docs/attributes.md."""
    lines = [
        "| name | type | example | meaning | NVIDIA's driver | devices |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| `{a.name}` | {a.type} | `{a.example}` | {a.meaning} | {a.nvidia} | {a.devices} |"
              for a in VOCABULARY]
    lines += [f"| `{c.name}` | capacity (quantity) | `{c.example}` | {c.meaning} | {c.nvidia} | {c.devices} |"
              for c in CAPACITIES]
    return "\n".join(lines) + "\n"
