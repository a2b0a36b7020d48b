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

Every shape names by default the DeviceClass `gpu-linked-<k>.<driver>` (k = 2..8, shipped in
deploy/deviceclasses/gpu-linked.yaml and the chart): the whole-GPU class's selector plus
`fits_selector(k)`, the device's `nvlinkCliqueSize` (the largest clique it is in) at least k.
A GPU that fails it is in no k-clique, so the claim finds the same GPUs; but on a node where
no GPU passes, the allocator gives up on the class alone, before any `matchAttribute` search.
In the class the test costs nothing: upstream's allocator evaluates the class's selector on
every device it looks at anyway (once per subrequest), and copies the device's attributes for
each expression it evaluates, so the same test as a selector of the claim cost one more copy
per device and subrequest (an impossible claim over 8 layers: 416 ms per attempt without it,
520 with it, at 100 DGX-1 nodes). With another class (`device_class=`), a one-subrequest
shape carries `fits_selector(k)` as a claim selector instead. Devices of an older driver
without the attribute pass it (`orValue(k)`): nothing is lost.
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


LINKED_CLASS_KS = range(2, 9)  # deploy/deviceclasses/gpu-linked.yaml, the chart's deviceClasses.linked


def linked_class(k: int, driver: str = DEFAULT_DRIVER_NAME) -> str | None:
    """The DeviceClass whose own selector carries `fits_selector(k)` (None above 8: none shipped)."""
    return f"gpu-linked-{k}.{driver}" if k in LINKED_CLASS_KS else None


def linked_class_selector(k: int, driver: str = DEFAULT_DRIVER_NAME) -> str:
    """That class's CEL: the whole-GPU class's test with the clique size second (a node without
    k linked GPUs fails on it for every GPU)."""
    d = f'device.attributes["{driver}"]'
    return (f'device.driver == "{driver}" && {fits_selector(k, driver)} && {d}.type == "gpu" && '
            f'!("migEnabled" in {d} && {d}.migEnabled)')


def fits_selector(k: int, driver: str = DEFAULT_DRIVER_NAME) -> str:
    """CEL: the device is in a clique of k or more GPUs (or does not say: an older driver)."""
    return f'device.attributes["{driver}"].?{NVLINK_CLIQUE_SIZE}.orValue({k}) >= {k}'


def _with_fits(k: int, driver: str, selectors: Sequence[str], fail_fast: bool) -> list[str]:
    return [fits_selector(k, driver), *selectors] if fail_fast and k >= 2 else list(selectors)


def _class(k: int, driver: str, device_class: str | None) -> tuple[str, bool]:
    """The class to name, and whether it carries the fail-fast test (a gpu-linked-<k> class)."""
    linked = linked_class(k, driver) if device_class is None else None
    return (linked, True) if linked else (device_class or driver, False)


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
    the shipped gpu-linked-<k> class, which carries the fail-fast test, and no selector of ours.
    `fail_fast` (another class): with `fits_selector(k)` in every subrequest; None: when there
    is one subrequest (module doc)."""
    chosen = list(range(layers)) if isinstance(layers, int) else list(layers)
    if not chosen or len(chosen) > NVLINK_LAYERS or len(set(chosen)) != len(chosen) or not all(
        0 <= n < NVLINK_LAYERS for n in chosen
    ):
        raise ValueError(
            f"layers {layers!r}: give 1 to {NVLINK_LAYERS} distinct layers of 0..{NVLINK_LAYERS - 1}"
        )
    device_class, carried = _class(k, driver, device_class)
    fits = len(chosen) == 1 if fail_fast is None else fail_fast
    selectors = _with_fits(k, driver, selectors, fits and not carried)
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
    fail_fast: bool = True,
) -> JSON:
    """k mutually linked GPUs through the list attribute nvlinkCliques (DRAListTypeAttributes).
    `device_class` and `fail_fast` as for `linked_gpus_ga`."""
    device_class, carried = _class(k, driver, device_class)
    selectors = _with_fits(k, driver, selectors, fail_fast and not carried)
    exactly: JSON = {"deviceClassName": device_class, "count": k}
    if selectors:
        exactly["selectors"] = _selectors(selectors)
    return {
        "requests": [{"name": request, "exactly": exactly}],
        "constraints": [{"requests": [request], "matchAttribute": f"{driver}/{NVLINK_CLIQUES}"}],
    }
