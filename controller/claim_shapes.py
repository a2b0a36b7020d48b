"""The documented claim shapes for "k GPUs that are all NVLink-connected with each other".

Two shapes, as the `spec.devices` of a ResourceClaim (JSON-ready, `resource.k8s.io/v1`):
- `linked_gpus_ga(k)`: for any cluster (GA API only). One request whose `firstAvailable`
  holds one subrequest per clique layer (`layer0` ... `layer7`, each `count: k`), and one
  `matchAttribute: <driver>/nvlinkClique<L>` constraint per subrequest, naming it as
  `<request>/<subrequest>`. The scheduler tries the layers in order and takes the first
  whose groups still hold k free GPUs; since the layers together hold every maximal
  clique, it finds k linked GPUs whenever the free GPUs of a node contain k linked ones.
  The allocation says which layer gave them (`request: gpus/layer1`).
- `linked_gpus_list(k)`: where the API server serves list-type attributes
  (DRAListTypeAttributes). One request, `count: k`, `matchAttribute: <driver>/nvlinkCliques`:
  with list attributes `matchAttribute` means "the chosen devices' lists share a value",
  and every value is a maximal clique.
deploy/examples/ holds these shapes (a unit test keeps them equal). Pure: builds JSON,
does no I/O and does not decide what a slice publishes.

`fleet_layers(k, topologies)`: the layers worth a subrequest for k GPUs on a given fleet,
those where some node has a group of k or more GPUs (`dra-driver inventory` shows each
node's layers). A subrequest for any other layer can never be satisfied, yet the scheduler
tries it on every node where the ones before it failed: with 8 subrequests, the DGX-1 quad
spent 60% of the scheduler's time in the DRA filter. `linked_gpus_ga(k, layers=...)` with
those layers finds the same GPUs as with all 8.

Every shape names by default the DeviceClass `gpu-linked.<driver>` (`linked_class`, shipped in
deploy/deviceclasses/gpu-linked.yaml and the chart), which has **no selector**: the claim's
`matchAttribute` constraint does the selecting. Only whole GPUs of this driver that are not in
MIG mode carry the clique attributes (`nvlinkClique<L>`, `nvlinkCliques`, `nvlinkDomain`): MIG
devices, share views, GPUs in MIG mode and other drivers' devices have none, and a device
without the constrained attribute is never picked. Upstream's allocator evaluates a class's
selector on every device it looks at, copying all the device's attributes for each expression
(docs/nvlink.md, "Where the CPU goes"); with no selector a linked claim costs no CEL at all,
only the `matchAttribute` search (on a node that cannot hold k, 2^g steps for a linked group
of g: `controller.claim_fit` adds the fail-fast selector where that is dearer). A request that
names this class without such a constraint would get any devices: the chart's admission policy
`linked-claims.<driver>` refuses it (deploy/helm/.../linked-claim-policy.yaml).
With another class (`device_class=`), a one-subrequest shape carries `fits_selector(k)` (the
device's `nvlinkCliqueSize` at least k) as a claim selector, so that a node without k linked
GPUs is dropped before the search; with the linked class only when asked (`fail_fast=True`:
`controller.claim_fit` asks where the search would cost more than the selector). Devices of
an older driver without the attribute pass it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from controller.attributes import NVLINK_CLIQUE_SIZE, NVLINK_CLIQUES, NVLINK_LAYERS, nvlink_layer_attribute
from dra_driver import DEFAULT_DRIVER_NAME
from dra_driver.gpu.topology import NvlinkTopology
from dra_driver.jsontypes import JSON

REQUEST = "gpus"


def layer_subrequest(layer: int) -> str:
    return f"layer{layer}"


def _selectors(selectors: Sequence[str]) -> list[JSON]:
    return [{"cel": {"expression": s}} for s in selectors]


def linked_class(driver: str = DEFAULT_DRIVER_NAME) -> str:
    """The selector-free DeviceClass for linked claims (module doc)."""
    return f"gpu-linked.{driver}"


def fits_selector(k: int, driver: str = DEFAULT_DRIVER_NAME) -> str:
    """CEL: the device is in a clique of k or more GPUs (or does not say: an older driver)."""
    return f'device.attributes["{driver}"].?{NVLINK_CLIQUE_SIZE}.orValue({k}) >= {k}'


def _with_fits(k: int, driver: str, selectors: Sequence[str], fail_fast: bool) -> list[str]:
    return [fits_selector(k, driver), *selectors] if fail_fast and k >= 2 else list(selectors)


def _class(driver: str, device_class: str | None) -> tuple[str, bool]:
    """The class to name, and whether it is the selector-free `linked_class`."""
    return (linked_class(driver), True) if device_class is None else (device_class, False)


def _fail_fast(asked: bool | None, linked: bool, one_subrequest: bool) -> bool:
    """Whether `fits_selector` goes into the claim. `asked` None: with another class where the
    claim has one subrequest (its selector is evaluated anyway), never with the linked class."""
    return asked if asked is not None else one_subrequest and not linked


def linked_gpus_ga(
    k: int,
    driver: str = DEFAULT_DRIVER_NAME,
    device_class: str | None = None,
    selectors: Sequence[str] = (),
    layers: int | Sequence[int] = NVLINK_LAYERS,
    request: str = REQUEST,
    fail_fast: bool | None = None,
) -> JSON:
    """k mutually linked GPUs through the clique layers (GA API: firstAvailable + matchAttribute).
    `layers`: how many (layer 0 up), or which (`fleet_layers`), in order. `device_class` None:
    the shipped selector-free `linked_class`, and no selector of ours.
    `fail_fast`: with `fits_selector(k)` in every subrequest; None: with another class where
    there is one subrequest (module doc)."""
    chosen = list(range(layers)) if isinstance(layers, int) else list(layers)
    if not chosen or len(chosen) > NVLINK_LAYERS or len(set(chosen)) != len(chosen) or not all(
        0 <= n < NVLINK_LAYERS for n in chosen
    ):
        raise ValueError(
            f"layers {layers!r}: give 1 to {NVLINK_LAYERS} distinct layers of 0..{NVLINK_LAYERS - 1}"
        )
    device_class, linked = _class(driver, device_class)
    selectors = _with_fits(k, driver, selectors, _fail_fast(fail_fast, linked, len(chosen) == 1))
    subrequests: list[JSON] = []
    for layer in chosen:
        sub: JSON = {"name": layer_subrequest(layer), "deviceClassName": device_class, "count": k}
        if selectors:
            sub["selectors"] = _selectors(selectors)
        subrequests.append(sub)
    return {
        "requests": [{"name": request, "firstAvailable": subrequests}],
        "constraints": [
            {"requests": [f"{request}/{layer_subrequest(layer)}"],
             "matchAttribute": f"{driver}/{nvlink_layer_attribute(layer)}"}
            for layer in chosen
        ],
    }


def fleet_layers(k: int, topologies: Iterable[NvlinkTopology]) -> tuple[int, ...]:
    """The layers where some node's group holds k or more GPUs, ascending; (0,) when none does
    (a claim needs one subrequest; it then fails as the full shape would)."""
    return layers_for(k, ({n: [len(g) for g in groups] for n, groups in enumerate(t.clique_layers.layers)}
                          for t in topologies))


def layers_for(k: int, nodes: Iterable[Mapping[int, Sequence[int]]]) -> tuple[int, ...]:
    """`fleet_layers` from each node's group sizes per layer (layer -> sizes), as read back
    from published slices (`controller.claim_fit`)."""
    fit = {n for node in nodes for n, sizes in node.items() if any(size >= k for size in sizes)}
    return tuple(sorted(fit)) or (0,)


def linked_gpus_list(
    k: int,
    driver: str = DEFAULT_DRIVER_NAME,
    device_class: str | None = None,
    selectors: Sequence[str] = (),
    request: str = REQUEST,
    fail_fast: bool | None = None,
) -> JSON:
    """k mutually linked GPUs through the list attribute nvlinkCliques (DRAListTypeAttributes).
    `device_class` and `fail_fast` as for `linked_gpus_ga`."""
    device_class, linked = _class(driver, device_class)
    selectors = _with_fits(k, driver, selectors, _fail_fast(fail_fast, linked, True))
    exactly: JSON = {"deviceClassName": device_class, "count": k}
    if selectors:
        exactly["selectors"] = _selectors(selectors)
    return {
        "requests": [{"name": request, "exactly": exactly}],
        "constraints": [{"requests": [request], "matchAttribute": f"{driver}/{NVLINK_CLIQUES}"}],
    }
