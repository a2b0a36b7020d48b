"""`kubectl gpu why POD` and `dra-driver explain POD`: why a pod's claims are not allocated,
node by node, or where they are.

Reads the API server only (the pod, its claims or their templates, the nodes, every
ResourceSlice, DeviceClass, DeviceTaintRule (at the newest version the server serves, none
where it serves none) and allocated ResourceClaim: what the scheduler's allocator reads) and
hands them to dra_driver.explain, which replays the allocator. A pod with an IMEX channel
claim also gets its ComputeDomain explained (dra_driver.commands.domains): the domains of the
pod's namespace are read only then, one LIST, so `why` on other pods costs nothing more. It
must NOT write anything or need anything on a node.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import asdict

import click

from dra_driver import kube, log
from dra_driver.commands import domains as cd
from dra_driver.commands.listing import RESOURCE_API, list_if_served, read_cluster
from dra_driver.commands.listing import list_all as _list
from dra_driver.explain.render import DEFAULT_NODES, render
from dra_driver.explain.why import PodClaim, PodReport, explain_pod
from dra_driver.jsontypes import JSON

# resource.k8s.io versions that have served DeviceTaintRules, newest first (v1alpha3: 1.33-1.35)
TAINT_RULE_VERSIONS = ("v1", "v1beta2", "v1alpha3")


class WhyError(click.ClickException):
    """The pod cannot be explained; the message says what to check."""


async def _get(api: kube.ApiClient, path: str) -> JSON | None:
    try:
        return await kube.request(api, "GET", path)
    except kube.ApiException as e:
        if e.status == 404:
            return None
        raise


async def pod_claims(api: kube.ApiClient, pod: JSON) -> list[PodClaim]:
    """The pod's claims: the ResourceClaim where it exists, else its template's spec."""
    namespace = pod["metadata"]["namespace"]
    generated = {
        s["name"]: s.get("resourceClaimName")
        for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
    }
    found = []
    for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
        name = entry.get("resourceClaimName") or generated.get(entry["name"])
        claim = (
            await _get(api, f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims/{name}") if name else None
        )
        template_spec = None
        if claim is None and entry.get("resourceClaimTemplateName"):
            template = await _get(
                api,
                f"{RESOURCE_API}/namespaces/{namespace}/resourceclaimtemplates/"
                f"{entry['resourceClaimTemplateName']}",
            )
            template_spec = ((template or {}).get("spec") or {}).get("spec") if template else None
        found.append(PodClaim(entry["name"], claim, template_spec))
    return found


async def taint_rules(api: kube.ApiClient, progress: Callable[[str], None]) -> list[JSON]:
    """The DeviceTaintRules, from the newest version served; none where none is (404). One the
    user may not list (403) is said on stderr: the explanation then misses its taints."""
    for version in TAINT_RULE_VERSIONS:
        try:
            return await _list(api, f"/apis/resource.k8s.io/{version}/devicetaintrules", "DeviceTaintRules",
                               {}, progress)
        except kube.ApiException as e:
            if e.status == 403:
                click.echo("\rwarning: DeviceTaintRules cannot be listed with these credentials: the taints "
                           "they put on devices are not counted", err=True)
                return []
            if e.status != 404:
                raise
    return []


async def _no_domains() -> list[JSON] | None:
    return None


async def read_why(
    api: kube.ApiClient, namespace: str, pod_name: str, progress: Callable[[str], None] = lambda _: None
) -> tuple[PodReport, tuple[cd.DomainReport, ...]]:
    """The pod's report, its headline saying what the pod waits for where its ComputeDomain
    holds it, and its channel claims' domains."""
    pod = await _get(api, f"/api/v1/namespaces/{namespace}/pods/{pod_name}")
    if pod is None:
        raise WhyError(f"pod {namespace}/{pod_name} does not exist (kubectl get pods -n {namespace})")
    claims = await pod_claims(api, pod)
    ref = next((r for pc in claims if (r := cd.domain_ref(pc.claim, pc.template_spec))), None)
    nodes, slices, classes, all_claims, rules, domains = await asyncio.gather(
        _list(api, "/api/v1/nodes", "Nodes", {}, progress),
        _list(api, f"{RESOURCE_API}/resourceslices", "ResourceSlices", {}, progress),
        _list(api, f"{RESOURCE_API}/deviceclasses", "DeviceClasses", {}, progress),
        _list(api, f"{RESOURCE_API}/resourceclaims", "ResourceClaims", {}, progress),
        taint_rules(api, progress),
        list_if_served(api, cd.domains_path(ref.driver, namespace), "ComputeDomains", {}, progress)
        if ref else _no_domains(),
    )
    allocated = [c for c in all_claims if (c.get("status") or {}).get("allocation")]
    by_class = {c["metadata"]["name"]: c for c in classes}
    report = explain_pod(pod, claims, nodes, slices, by_class, allocated, rules)
    found = cd.domain_reports(pod, claims, domains, slices) if ref else ()
    return cd.with_domains(report, found), found


async def read_report(
    api: kube.ApiClient, namespace: str, pod_name: str, progress: Callable[[str], None] = lambda _: None
) -> PodReport:
    return (await read_why(api, namespace, pod_name, progress))[0]


def explain(
    pod: str, namespace: str, kubeconfig: str | None, verbose: bool, all_nodes: bool, output: str
) -> None:
    if "/" in pod:
        namespace, pod = pod.split("/", 1)

    report, domains = read_cluster(kubeconfig, lambda api, progress: read_why(api, namespace, pod, progress),
                                   f"reading pod {namespace}/{pod} and the cluster's devices failed")
    if output == "json":
        click.echo(json.dumps({**asdict(report), "computeDomains": [asdict(d) for d in domains]}, indent=2))
    else:
        click.echo("\n".join([render(report, verbose=verbose, all_nodes=all_nodes, limit=DEFAULT_NODES),
                              *cd.render_why(domains)]))


def _options(f: Callable[..., None]) -> Callable[..., None]:
    for option in reversed(
        [
            click.argument("pod"),
            click.option(
                "-n",
                "--namespace",
                default="default",
                show_default=True,
                help="The pod's namespace (or write POD as namespace/name).",
            ),
            click.option("-v", "--verbose", is_flag=True, help="Every request and subrequest per node."),
            click.option("--all", "all_nodes", is_flag=True, help="Every node, not only the closest few."),
            click.option(
                "-o", "--output", type=click.Choice(["text", "json"]), default="text", show_default=True
            ),
            click.option(
                "--kubeconfig",
                type=click.Path(dir_okay=False),
                default=None,
                help="Kubeconfig file; default: in-cluster, then $KUBECONFIG or ~/.kube/config.",
            ),
        ]
    ):
        f = option(f)
    return f


@click.command("explain")
@_options
def explain_command(
    pod: str, namespace: str, verbose: bool, all_nodes: bool, output: str, kubeconfig: str | None
) -> None:
    """Why POD's GPU claims are not allocated, per node and request, or where they are."""
    explain(pod, namespace, kubeconfig, verbose, all_nodes, output)


@click.command("kubectl-gpu-why", context_settings={"help_option_names": ["-h", "--help"]})
@_options
def kubectl_gpu_why(
    pod: str, namespace: str, verbose: bool, all_nodes: bool, output: str, kubeconfig: str | None
) -> None:
    """kubectl gpu why POD: why the pod is pending, per node and request (as `dra-driver explain`)."""
    log.configure("warning", "console")
    explain(pod, namespace, kubeconfig, verbose, all_nodes, output)
