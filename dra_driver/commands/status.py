"""`dra-driver status --node N` and `kubectl gpu N`: who holds which GPU of one node.

Reads the API server only (the node, its ResourceSlices of the driver, the ResourceClaims
allocated in its pools, the pods on it, the ComputeDomains where it has a channel) and prints
the node's GPUs (product, memory, UUID, health from the devices' taints), the NVLink matrix
(GPUs that share an `nvlinkClique<L>`, `nvlinkCliques` or `nvlinkDomain` value, plus
`nvlinkPeers` where `--topology-detail-attributes` publishes it), and per device the claims
and pods that hold it: whole GPUs, memory shares with the memory each got, MIG instances;
with the `Ready` condition the plugin wrote in the claim's status. A claim with adminAccess
is listed on its devices but holds none of them: the scheduler still gives them to other
claims, so a device only such claims have is `free, admin access`. A node with an IMEX
channel (`--compute-domains`) also shows who holds it and for which ComputeDomain, and the
domains it is in: their status and this node's entry (dra_driver.commands.domains); where
the server does not serve ComputeDomains (no CRD), nothing about domains.
`-o json` prints the same view as JSON. A big cluster's claims are read page by page with a
progress line on stderr.

`node_view` (JSON in, view out) and `render` are pure; only `read_node` does I/O. It must
NOT need anything on the node itself (no NVML, no checkpoint), and never writes.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import click

from controller.attributes import LINKED_SET_ATTRIBUTES
from dra_driver import DEFAULT_DRIVER_NAME, kube, log
from dra_driver.commands import domains as cd
from dra_driver.commands.listing import RESOURCE_API, list_if_served, read_cluster
from dra_driver.commands.listing import list_all as _list
from dra_driver.explain import state as explain_state
from dra_driver.jsontypes import JSON


class StatusError(click.ClickException):
    """What the user asked about cannot be shown; the message says what to check."""


# --------------------------------------------------------------------------- the view


@dataclass(frozen=True)
class Holder:
    claim_namespace: str
    claim_name: str
    claim_uid: str
    pods: tuple[str, ...]  # "namespace/name (Phase)"
    share_id: str | None = None
    memory: str | None = None  # what a share consumed
    ready: str | None = None  # the Ready condition the plugin wrote: "True", "False: <reason>"
    uuid: str | None = None  # what the plugin wrote in status.devices (a made MIG instance's UUID)
    # adminAccess: it does not hold the device (the scheduler gives it to other claims too)
    admin_access: bool = False


@dataclass(frozen=True)
class DeviceRow:
    name: str
    kind: str  # whole | share | mig
    uuid: str
    memory: str
    holders: tuple[Holder, ...] = ()
    # MIG placements: free | held | static | blocked by <held devices>; whole GPUs in MIG mode too
    state: str = ""
    profile: str | None = None


@dataclass(frozen=True)
class GpuRow:
    index: int
    name: str
    product: str
    memory: str
    pci_bus_id: str
    uuid: str
    health: str  # Healthy | Unhealthy
    taints: tuple[str, ...]
    nvlink_peers: tuple[int, ...]
    devices: tuple[DeviceRow, ...] = field(default=())
    mig_mode: bool = False  # it publishes MIG devices (placements or instances)
    memory_slices: tuple[str, ...] = ()  # per memory slice: "free" or the device holding it
    can_carve: tuple[str, ...] = ()  # "1g.18gb x4": placements free now, per profile
    blocked: tuple[str, ...] = ()  # "3g.71gb x1": placements that overlap held slices


@dataclass(frozen=True)
class NodeView:
    node: str
    driver: str
    gpus: tuple[GpuRow, ...]
    channels: tuple[cd.ChannelRow, ...] = ()
    domains: tuple[cd.DomainRow, ...] = ()  # none where ComputeDomains are not served


def _attr(device: JSON, name: str) -> Any:
    value = (device.get("attributes") or {}).get(name) or {}
    for kind in ("string", "int", "bool", "version", "ints", "strings"):
        if kind in value:
            return value[kind]
    return None


def _peers(value: Any) -> tuple[int, ...]:
    """nvlinkPeers as published: a list of ints, or "1,2,3" with ranges such as "0-3,5"."""
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    if not isinstance(value, str) or not value:
        return ()
    peers: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if match:
            lo, hi = int(match[1]), int(match[2] or match[1])
            peers.extend(range(lo, hi + 1))
    return tuple(peers)


def _clique_links(slices: Iterable[JSON]) -> dict[int, set[int]]:
    """GPU index -> the GPUs that share a value of a clique attribute with it (a layer,
    nvlinkCliques, nvlinkDomain: controller.attributes.LINKED_SET_ATTRIBUTES): directly linked.
    The layers hold every maximal clique of the node's whole GPUs unless it has more than they
    hold (the driver logs it), so this is the matrix of the whole GPUs without nvlinkPeers
    (opt-in); links to a GPU in MIG mode are in no clique."""
    members: dict[str, set[int]] = {}  # a clique's id names its members: one id, one set
    for s in slices:
        for device in s["spec"].get("devices") or []:
            index = _attr(device, "index")
            if index is None:
                continue
            for name in LINKED_SET_ATTRIBUTES & set(device.get("attributes") or {}):
                value = _attr(device, name)
                for v in value if isinstance(value, list) else [value]:
                    members.setdefault(str(v), set()).add(int(index))
    links: dict[int, set[int]] = {}
    for group in members.values():
        for a in group:
            links.setdefault(a, set()).update(group - {a})
    return links


def _row_peers(whole: JSON, from_cliques: set[int]) -> tuple[int, ...]:
    """The published nvlinkPeers (opt-in) and the links the clique layers show, together."""
    return tuple(sorted(set(_peers(_attr(whole, "nvlinkPeers"))) | from_cliques))


def _kind(device: JSON) -> str:
    kind = _attr(device, "type")
    return {"gpu": "whole", "gpu-share": "share", "mig": "mig"}.get(str(kind), str(kind))


def _memory(device: JSON) -> str:
    return str(((device.get("capacity") or {}).get("memory") or {}).get("value", "-"))


def _status_uuid(claim: JSON, driver: str, pool: str, device: str, share_id: str | None) -> str | None:
    for entry in (claim.get("status") or {}).get("devices") or []:
        if (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID")) == (
            driver, pool, device, share_id
        ):
            value = (entry.get("data") or {}).get("uuid")
            return str(value) if value else None
    return None


def _slices_of(device: JSON) -> set[int]:
    """The memory slices a MIG device spans: the counters it consumes (a placement) or its
    memorySlice<i> capacities (an instance that exists)."""
    found = {int(n.removeprefix("memory-slice-")) for c in device.get("consumesCounters") or []
             for n in c.get("counters") or {} if n.startswith("memory-slice-")}
    found |= {int(n.removeprefix("memorySlice")) for n in device.get("capacity") or {}
              if n.startswith("memorySlice") and n.removeprefix("memorySlice").isdigit()}
    return found


def _mig_states(node: str, driver: str, slices: Sequence[JSON], claims: Sequence[JSON]) -> dict[str, str]:
    """Per device that consumes counters: held, free, or blocked by which held devices."""
    node_json: JSON = {"metadata": {"name": node}}
    state = explain_state.held(c for c in claims if (c.get("status") or {}).get("allocation"))
    states: dict[str, str] = {}
    for pool in explain_state.pools([s for s in slices if s["spec"].get("driver") == driver], node_json):
        left = explain_state.counters_left(pool, state)
        takers = explain_state.counter_takers(pool, state)
        for d in pool.devices:
            if state.allocated(d.id):
                states[d.name] = "held"
            elif d.consumes():
                short = explain_state.counters_short(d, left)
                by = sorted({t.name for pair in short for t in takers.get(pair, [])})
                states[d.name] = f"blocked by {', '.join(by) or 'overdrawn counters'}" if short else "free"
    return states


def _ready(claim: JSON, driver: str, pool: str, device: str, share_id: str | None) -> str | None:
    for entry in (claim.get("status") or {}).get("devices") or []:
        if (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID")) != (
            driver, pool, device, share_id
        ):
            continue
        for c in entry.get("conditions") or []:
            if c.get("type") == "Ready":
                return "True" if c.get("status") == "True" else f"{c.get('status')}: {c.get('reason', '')}"
    return None


def node_view(node: str, driver: str, slices: Sequence[JSON], claims: Sequence[JSON],
              pods: Sequence[JSON], domains: Sequence[JSON] | None = None) -> NodeView:
    """The node's GPUs and their holders, its channels and ComputeDomains (`domains`: None where
    they are not served), from the API objects (pure)."""
    pools = {s["spec"]["pool"]["name"] for s in slices}
    phases = {p["metadata"]["uid"]: p.get("status", {}).get("phase", "Unknown") for p in pods}
    held: dict[str, list[Holder]] = {}
    for claim in claims:
        meta = claim["metadata"]
        status = claim.get("status") or {}
        reserved = [r for r in status.get("reservedFor") or [] if r.get("resource") == "pods"]
        pod_names = tuple(f"{meta['namespace']}/{r['name']} ({phases.get(r.get('uid'), 'not on this node')})"
                          for r in reserved)
        allocation = status.get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            if result.get("driver") != driver or result.get("pool") not in pools:
                continue
            share = result.get("shareID")
            memory = (result.get("consumedCapacity") or {}).get("memory") if share else None
            held.setdefault(result["device"], []).append(Holder(
                meta["namespace"], meta["name"], meta["uid"], pod_names, share, memory,
                _ready(claim, driver, result["pool"], result["device"], share),
                _status_uuid(claim, driver, result["pool"], result["device"], share),
                bool(result.get("adminAccess")),
            ))

    mig_states = _mig_states(node, driver, slices, claims)
    by_gpu: dict[int, dict[str, Any]] = {}
    for s in slices:
        for device in s["spec"].get("devices") or []:
            kind = _kind(device)
            index = _attr(device, "parentIndex") if kind == "mig" else _attr(device, "index")
            if index is None:
                continue
            gpu = by_gpu.setdefault(int(index), {"devices": [], "taints": set(), "whole": None,
                                                 "any": device, "mig": []})
            if kind == "whole":
                gpu["whole"] = device
            if kind == "mig":
                gpu["mig"].append(device)
            taints = device.get("taints") or []
            gpu["taints"].update(f"{t['key']}={t.get('value', '')}:{t['effect']}" for t in taints)
            holders = tuple(held.get(device["name"], ()))
            made = next((h.uuid for h in holders if h.uuid), None)
            static = kind == "mig" and bool(_attr(device, "uuid"))
            pending = "(made at Prepare)" if holders and kind == "mig" else "-"
            uuid = _attr(device, "uuid") or made or pending
            row_state = "static" if static else mig_states.get(device["name"], "")
            gpu["devices"].append(DeviceRow(device["name"], kind, str(uuid), _memory(device), holders,
                                            row_state, _attr(device, "profile")))
    clique_links = _clique_links(slices)
    rows = []
    for index in sorted(by_gpu):
        gpu = by_gpu[index]
        whole = gpu["whole"] or gpu["any"]
        mig_mode = bool(gpu["mig"])
        taints = tuple(sorted(gpu["taints"]))
        devices = tuple(sorted(gpu["devices"], key=lambda d: d.name))
        memory_slices: tuple[str, ...] = ()
        if mig_mode:
            spans = {d["name"]: _slices_of(d) for d in gpu["mig"]}
            count = max((max(v) + 1 for v in spans.values() if v), default=0)
            taken = {i: name for row in devices if row.kind == "mig" and row.state in ("held", "static")
                     for name in [row.name] for i in spans.get(name, ())}
            memory_slices = tuple(taken.get(i, "free") for i in range(count))
        placements = [d for d in devices if d.kind == "mig" and d.state not in ("held", "static")]
        rows.append(GpuRow(
            index=index,
            name=f"gpu-{index}",
            product=str(_attr(whole, "productName") or "-"),
            memory="MIG mode" if mig_mode else _memory(whole),
            pci_bus_id=str(_attr(whole, "resource.kubernetes.io/pciBusID") or "-"),
            uuid=str((_attr(whole, "uuid") if gpu["whole"] else _attr(whole, "parentUUID")) or "-"),
            health="Unhealthy" if taints else "Healthy",
            taints=taints,
            nvlink_peers=_row_peers(whole, clique_links.get(index, set())),
            devices=devices,
            mig_mode=mig_mode,
            memory_slices=memory_slices,
            can_carve=_per_profile(d for d in placements if d.state == "free"),
            blocked=_per_profile(d for d in placements if d.state.startswith("blocked")),
        ))
    # A link is both GPUs' (a GPU in MIG mode with a static instance publishes no peers itself).
    linked = {r.index: set(r.nvlink_peers) for r in rows}
    for a, peers in list(linked.items()):
        for b in peers:
            linked.setdefault(b, set()).add(a)
    rows = [replace(r, nvlink_peers=tuple(sorted(linked.get(r.index, ())))) for r in rows]
    channels, domain_rows = cd.node_channels(node, driver, slices, claims, domains)
    return NodeView(node, driver, tuple(rows), channels, domain_rows)


def _per_profile(rows: Iterable[DeviceRow]) -> tuple[str, ...]:
    counts = Counter(str(r.profile) for r in rows)
    return tuple(f"{p} x{n}" for p, n in sorted(counts.items()))


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in (header, *rows)]


def render(view: NodeView) -> str:
    """The view as a person reads it in a terminal."""
    lines = [f"Node {view.node}: {len(view.gpus)} GPUs of driver {view.driver}", ""]
    lines += _table(
        ("GPU", "PRODUCT", "MEMORY", "PCI BUS ID", "UUID", "HEALTH", "TAINTS"),
        [(g.name, g.product, g.memory, g.pci_bus_id, g.uuid, g.health, ",".join(g.taints) or "-")
         for g in view.gpus],
    )
    for g in view.gpus:
        if not g.mig_mode:
            continue
        spans: list[str] = []
        for i, holder in enumerate(g.memory_slices):
            if spans and spans[-1].endswith(f": {holder}"):
                first = spans[-1].split(":")[0].split("-")[0]
                spans[-1] = f"{first}-{i}: {holder}"
            else:
                spans.append(f"{i}: {holder}")
        lines += ["", f"{g.name} is in MIG mode; memory slices: " + "; ".join(spans)]
        lines.append(f"  can carve now: {', '.join(g.can_carve) or 'nothing'}")
        if g.blocked:
            lines.append(f"  blocked by held slices: {', '.join(g.blocked)}")
    indices = [g.index for g in view.gpus]
    if any(g.nvlink_peers for g in view.gpus):
        lines += ["", "NVLink (NV: linked, -: not linked)"]
        peers = {g.index: set(g.nvlink_peers) for g in view.gpus}
        lines += _table(
            ("", *(f"gpu-{i}" for i in indices)),
            [(f"gpu-{a}", *("X" if a == b else "NV" if b in peers[a] else "-" for b in indices))
             for a in indices],
        )
    lines += ["", "Devices and who holds them (MIG placements not held: see above)"]
    rows = []
    for g in view.gpus:
        for d in g.devices:
            if d.kind == "mig" and not d.holders and d.state != "static":
                continue  # free and blocked placements are counted per profile above
            state = d.state or ("held" if any(not h.admin_access for h in d.holders) else "free")
            if not d.holders and d.kind != "share":  # a free GPU shows once, as itself
                rows.append((d.name, d.kind, d.memory, state, "-", "-", "-", d.uuid))
            for h in d.holders:
                detail = f"{h.memory} of {d.memory}" if h.memory else d.memory
                rows.append((d.name, d.kind, detail, f"{state}, admin access" if h.admin_access else state,
                             f"{h.claim_namespace}/{h.claim_name}", ", ".join(h.pods) or "-", h.ready or "-",
                             d.uuid))
    lines += _table(("DEVICE", "KIND", "MEMORY", "STATE", "CLAIM", "PODS", "READY", "UUID"), rows)
    if view.channels:
        lines += ["", "IMEX channels (ComputeDomains)"]
        lines += _table(("CHANNEL", "CLIQUE", "STATE", "CLAIM", "PODS", "DOMAIN"),
                        [(c.device, c.clique, "held" if c.claim else "free", c.claim or "-",
                          ", ".join(c.pods) or "-", c.domain or "-") for c in view.channels])
    if view.domains:
        lines += ["", "ComputeDomains of this node"]
        lines += _table(("DOMAIN", "STATUS", "JOINED", "THIS NODE", "WAITS FOR"),
                        [(d.domain, d.status, f"{d.joined} of {d.num_nodes}", d.this_node,
                          d.waiting_for or "-") for d in view.domains])
    return "\n".join(lines)


# --------------------------------------------------------------------------- reading


async def read_node(api: kube.ApiClient, node: str, driver: str,
                    progress: Callable[[str], None]) -> NodeView:
    try:
        await kube.request(api, "GET", f"/api/v1/nodes/{node}")
    except kube.ApiException as e:
        if e.status != 404:
            raise
        slices = await _list(api, f"{RESOURCE_API}/resourceslices", "ResourceSlices",
                             {"fieldSelector": f"spec.driver={driver}"}, progress)
        known = sorted({s["spec"].get("nodeName") for s in slices if s["spec"].get("nodeName")})
        raise StatusError(f"node {node!r} does not exist in this cluster; nodes with GPUs of driver "
                          f"{driver}: {', '.join(known) or 'none'}") from None
    slices = await _list(api, f"{RESOURCE_API}/resourceslices", "ResourceSlices",
                         {"fieldSelector": f"spec.nodeName={node},spec.driver={driver}"}, progress)
    if not slices:
        raise StatusError(f"node {node!r} has no ResourceSlices of driver {driver}: is the driver's kubelet "
                          "plugin running there (kubectl get pods -o wide), and is --driver-name right?")
    claims = await _list(api, f"{RESOURCE_API}/resourceclaims", "ResourceClaims", {}, progress)
    pods = await _list(api, "/api/v1/pods", "Pods", {"fieldSelector": f"spec.nodeName={node}"}, progress)
    domains = None
    if cd.channel_cliques(slices, driver):  # only a node with a channel joins a domain
        domains = await list_if_served(api, cd.domains_path(driver), "ComputeDomains", {}, progress)
    return node_view(node, driver, slices, claims, pods, domains)


def show(node: str, driver: str, kubeconfig: str | None, output: str) -> None:
    view = read_cluster(kubeconfig, lambda api, progress: read_node(api, node, driver, progress),
                        f"reading node {node!r} from the API server failed")
    click.echo(json.dumps(asdict(view), indent=2) if output == "json" else render(view))


_OUTPUT = click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text",
                       show_default=True)
_DRIVER = click.option("--driver-name", default=DEFAULT_DRIVER_NAME, show_default=True,
                       help="The DRA driver name whose devices are shown.")
_KUBECONFIG = click.option("--kubeconfig", type=click.Path(dir_okay=False), default=None,
                           help="Kubeconfig file; default: in-cluster, then $KUBECONFIG or ~/.kube/config.")


@click.command("status")
@click.option("--node", required=True, help="The node to show.")
@_DRIVER
@_KUBECONFIG
@_OUTPUT
def status(node: str, driver_name: str, kubeconfig: str | None, output: str) -> None:
    """The node's GPUs, NVLink matrix, and the claims and pods holding each device (API server only)."""
    show(node, driver_name, kubeconfig, output)


@click.command("kubectl-gpu", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("node")
@_DRIVER
@_KUBECONFIG
@_OUTPUT
def kubectl_gpu(node: str, driver_name: str, kubeconfig: str | None, output: str) -> None:
    """kubectl gpu NODE: the node's GPUs and who holds them (as `dra-driver status --node NODE`)."""
    log.configure("warning", "console")
    show(node, driver_name, kubeconfig, output)


def main() -> None:
    """The `kubectl-gpu` entry point (kubectl finds it on PATH as the `gpu` plugin)."""
    args = sys.argv[1:]
    if args[:1] == ["why"]:  # kubectl gpu why POD (dra_driver.commands.why)
        from dra_driver.commands.why import kubectl_gpu_why

        kubectl_gpu_why(prog_name="kubectl gpu why", auto_envvar_prefix="DRA_DRIVER", args=args[1:])
        return
    if args[:1] == ["claim"]:  # kubectl gpu claim --linked K (dra_driver.commands.claim)
        from dra_driver.commands.claim import kubectl_claim

        kubectl_claim(prog_name="kubectl gpu claim", auto_envvar_prefix="DRA_DRIVER", args=args[1:])
        return
    kubectl_gpu(prog_name="kubectl gpu", auto_envvar_prefix="DRA_DRIVER", args=args)
