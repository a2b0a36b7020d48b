"""`dra-driver claim --linked K` and `kubectl gpu claim --linked K`: print the claim for K linked GPUs.

Reads the driver's ResourceSlices from the API server and prints, as YAML, the
ResourceClaimTemplate for K mutually NVLink-linked GPUs that is cheapest for the scheduler
and still complete for this fleet (`controller.claim_fit`: fewest subrequests, on the
selector-free class `gpu-linked.<driver name>` (deploy/deviceclasses/gpu-linked.yaml), or on
the driver's whole-GPU class `<driver name>` with a selector where that class is not served);
what it chose and why goes to stderr, so that stdout pipes into `kubectl apply -f -` as it is.
Whether the server keeps list-type attributes is read from the fleet's slices: any list value
published says it does (`lists_kept`). Wiring only: the choice is `controller.claim_fit`'s.
It must NOT write anything to the cluster.
"""

from __future__ import annotations

import asyncio

import click
import yaml

from controller.attributes import NVLINK_CLIQUES, NVLINK_LAYERS, TYPE, nvlink_layer_attribute
from controller.claim_fit import FittedClaim, claim_template, fit_linked_claim
from controller.claim_shapes import linked_class
from dra_driver import DEFAULT_DRIVER_NAME, kube, log
from dra_driver.jsontypes import JSON

RESOURCE_API = "/apis/resource.k8s.io/v1"
PAGE = 500
_LIST_KINDS = frozenset({"ints", "strings", "bools", "versions"})  # DRAListTypeAttributes' value kinds


def lists_kept(slices: list[JSON], driver: str) -> bool:
    """Whether the server keeps list-type attributes: some device of the driver publishes one
    (a server without DRAListTypeAttributes drops them, so the plugin publishes none there)."""
    return any(kind in _LIST_KINDS
               for s in slices if (s.get("spec") or {}).get("driver") == driver
               for device in s["spec"].get("devices") or []
               for value in (device.get("attributes") or {}).values() for kind in value)


def with_clique_lists(slices: list[JSON], driver: str) -> list[JSON]:
    """The slices as `claim_fit` reads them where the server keeps list-type attributes: a whole
    GPU in no clique has an empty nvlinkCliques. The plugin leaves an empty list out, and
    claim_fit takes a node none of whose GPUs publishes nvlinkCliques (a PCIe-only node, a
    one-GPU node) for a server that keeps no lists: its note then said so of this very server."""
    if not lists_kept(slices, driver):
        return slices
    out = []
    for s in slices:
        spec = s.get("spec") or {}
        devices = []
        for device in spec.get("devices") or []:
            attributes = device.get("attributes") or {}
            linked = NVLINK_CLIQUES in attributes or any(
                nvlink_layer_attribute(n) in attributes for n in range(NVLINK_LAYERS))
            if attributes.get(TYPE) == {"string": "gpu"} and not linked:
                device = {**device, "attributes": {**attributes, NVLINK_CLIQUES: {"strings": []}}}
            devices.append(device)
        out.append({**s, "spec": {**spec, "devices": devices}})
    return out


async def read_slices(kubeconfig: str | None, driver: str) -> list[JSON]:
    api = await kube.load_client(kubeconfig)
    items: list[JSON] = []
    query = {"fieldSelector": f"spec.driver={driver}", "limit": str(PAGE)}
    try:
        while True:
            page = await kube.request(api, "GET", f"{RESOURCE_API}/resourceslices", query=query)
            items.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
            query = {**query, "continue": token}
    finally:
        await api.close()


async def class_served(kubeconfig: str | None, name: str) -> bool:
    """Whether the DeviceClass exists (the chart's deviceClasses.linked may be off)."""
    api = await kube.load_client(kubeconfig)
    try:
        await kube.request(api, "GET", f"{RESOURCE_API}/deviceclasses/{name}")
        return True
    except kube.ApiException as e:
        if e.status == 404:
            return False
        raise
    finally:
        await api.close()


def _fit(linked: int, driver: str, device_class: str | None, selectors: tuple[str, ...],
         kubeconfig: str | None) -> FittedClaim:
    try:
        slices = asyncio.run(read_slices(kubeconfig, driver))
        wanted = linked_class(driver) if device_class is None else None
        if wanted and not asyncio.run(class_served(kubeconfig, wanted)):
            click.echo(f"# DeviceClass {wanted} not found (chart value deviceClasses.linked off?): "
                       f"the claim uses {driver} and a selector instead", err=True)
            device_class = driver
    except (kube.ApiException, OSError, TimeoutError) as e:
        raise click.ClickException(
            f"reading the ResourceSlices or DeviceClasses of {driver} failed: {e}") from None
    if not slices:
        raise click.ClickException(f"no ResourceSlices of driver {driver}: is the driver installed, and is "
                                   "--driver-name right?")
    try:
        return fit_linked_claim(linked, with_clique_lists(slices, driver), driver, device_class, selectors)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--linked") from None


def emit(linked: int, driver: str, device_class: str | None, selectors: tuple[str, ...], name: str | None,
         namespace: str | None, kubeconfig: str | None) -> None:
    fitted = _fit(linked, driver, device_class, selectors, kubeconfig)
    click.echo(f"# {fitted.nodes_that_fit} of {fitted.nodes} nodes can hold {linked} linked GPUs; "
               f"{fitted.note}", err=True)
    template = claim_template(name or f"linked-{linked}-gpus", fitted, namespace)
    click.echo(yaml.safe_dump(template, sort_keys=False, width=120), nl=False)


_OPTIONS = [
    click.option("--linked", "linked", type=int, required=True, metavar="K",
                 help="How many GPUs, all directly NVLink-linked with each other."),
    click.option("--name", default=None, help="The template's name [default: linked-K-gpus]."),
    click.option("--namespace", "-n", default=None, help="Put this namespace in the template's metadata."),
    click.option("--selector", "selectors", multiple=True, metavar="CEL",
                 help="A CEL selector added to every subrequest (memory, product...); repeatable."),
    click.option("--device-class", default=None,
                 help="The DeviceClass [default: gpu-linked.<driver name> where served, "
                      "else the driver name]."),
    click.option("--driver-name", default=DEFAULT_DRIVER_NAME, show_default=True),
    click.option("--kubeconfig", type=click.Path(dir_okay=False), default=None,
                 help="Kubeconfig file; default: in-cluster, then $KUBECONFIG or ~/.kube/config."),
]


def _with_options(f: click.decorators.FC) -> click.decorators.FC:
    for option in reversed(_OPTIONS):
        f = option(f)
    return f


@click.command("claim")
@_with_options
def claim(linked: int, name: str | None, namespace: str | None, selectors: tuple[str, ...],
          device_class: str | None, driver_name: str, kubeconfig: str | None) -> None:
    """Print the cheapest complete ResourceClaimTemplate for K linked GPUs on this cluster's fleet."""
    emit(linked, driver_name, device_class, selectors, name, namespace, kubeconfig)


@click.command("kubectl-gpu-claim", context_settings={"help_option_names": ["-h", "--help"]})
@_with_options
def kubectl_claim(linked: int, name: str | None, namespace: str | None, selectors: tuple[str, ...],
                  device_class: str | None, driver_name: str, kubeconfig: str | None) -> None:
    """kubectl gpu claim --linked K: as `dra-driver claim --linked K`."""
    log.configure("warning", "console")
    emit(linked, driver_name, device_class, selectors, name, namespace, kubeconfig)
