"""Least privilege, against the real API server with the chart's own RBAC and policies.

Two halves:
* The grants are derived from the code. Every `kube.request` / `kube.watch` / `kube.list_all`
  call site in what `dra-driver kubelet-plugin` imports is read from the source (method and path) and
  turned into an RBAC (group, resource, verb); the chart's ClusterRole must grant exactly
  that set, no more and no less. The daemon's code paths then run in this process with a
  token bound to a pod on node A, through the chart's RBAC and policies: every call they
  make must be allowed and must come from a call site the scan found (so the scan misses
  nothing that runs).
* The denials: the same token may not write node B's slices, another driver's slices for
  node A, slices with allNodes or a node selector, another pool, taints in node B's slice,
  a claim's status, or Events about other things; each is asserted with the API server's
  answer (422 with the policy's message, 403 from RBAC).
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.util
import json
import re
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from controller.plan import SLICES
from controller.publisher import slice_controller
from dra_driver import kube
from dra_driver.gpu import discover
from dra_driver.health.notify import ClaimEvents, ClaimUse
from dra_driver.plugin.claim_source import ClaimReader
from dra_driver.plugin.claim_status import ClaimStatus
from dra_driver.plugin.claims import ClaimRef
from tests.harness.cluster import ControlPlane
from tests.harness.driver_image import CHART, build_helm
from tests.harness.helm import Helm
from tests.harness.objects import (
    create_namespace,
    create_node,
    create_object,
    delete_node_and_slices,
    sync_request,
    wait_for,
    wait_for_async,
)

REPO = Path(__file__).resolve().parents[2]
RELEASE = "lp"
NAMESPACE = "lp-gpu-dra-driver"
DRIVER = "gpu.dra-driver.dev"
ENTRY = "dra_driver.commands.kubelet_plugin"
CD_ENTRY = "dra_driver.commands.compute_domain_controller"
PACKAGES = ("dra_driver", "controller")
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"

# Call sites the daemon's import closure holds but the daemon never reaches, with the reason.
NOT_REACHED_BY_THE_PLUGIN = {
    (
        "controller/reconciler.py",
        "list",
        "",
        "nodes",
    ): "the node list is for several pools at once (`dra-driver controller`); the plugin has one",
}


@dataclass(frozen=True, order=True)
class Grant:
    group: str
    resource: str  # with its subresource: resourceclaims/status
    verb: str


# GET /version: granted to every user, authenticated or not, by the bootstrap ClusterRole
# system:public-info-viewer; the chart grants nothing for it.
PUBLIC_VERSION = Grant("", "nonResourceURL:/version", "get")


# -- the grants the code needs, from its source -------------------------------------------------


def _closure(entry: str) -> set[str]:
    """The modules of PACKAGES that `entry` imports, transitively (from the source, any branch)."""
    seen: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        tree = ast.parse(Path(spec.origin).read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for n in names:
                if n.split(".")[0] in PACKAGES and importlib.util.find_spec(n.rsplit(".", 1)[0]) is not None:
                    try:
                        if importlib.util.find_spec(n) is not None:
                            todo.append(n)
                    except ModuleNotFoundError:
                        pass
    return {m for m in seen if m.split(".")[0] in PACKAGES}


def _text(node: ast.expr, module: Any, local: dict[str, ast.expr]) -> str | None:
    """A path expression with its constants (the function's own assignments, then the
    module's names) filled in and every other part as '{}'."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in local:
            return _text(local.pop(node.id), module, local)
        value = getattr(module, node.id, None)
        return value if isinstance(value, str) else None
    if isinstance(node, ast.JoinedStr):
        parts = []
        for part in node.values:
            if isinstance(part, ast.FormattedValue):
                resolved = _text(part.value, module, {}) if isinstance(part.value, ast.Name) else None
                parts.append(resolved if resolved is not None else "{}")
            else:
                parts.append(_text(part, module, local) or "")
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left, module, local), _text(node.right, module, local)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        template = _text(node.func.value, module, local)
        if template is not None:
            return re.sub(r"\{[^}]*\}", "{}", template)
    return None


def grant_for(method: str, path: str) -> tuple[Grant, bool]:
    """The RBAC grant an API call needs, and whether it is namespaced."""
    parts = [p for p in path.split("?", 1)[0].split("/") if p]
    if parts == ["version"] and method == "GET":
        return PUBLIC_VERSION, False
    if parts[0] == "api":
        group, rest = "", parts[2:]
    elif parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        raise ValueError(f"not an API path: {path}")
    namespaced = len(rest) >= 3 and rest[0] == "namespaces"
    if namespaced:
        rest = rest[2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    named = len(rest) > 1
    verb = {
        "GET": "get" if named else "list",
        "WATCH": "watch",
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if named else "deletecollection",
    }[method]
    return Grant(group, resource, verb), namespaced


def _assignments(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> dict[str, ast.expr]:
    """`name = value` in the function around `node`."""
    while node in parents and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        node = parents[node]
    return {
        a.targets[0].id: a.value
        for a in ast.walk(node)
        if isinstance(a, ast.Assign) and len(a.targets) == 1 and isinstance(a.targets[0], ast.Name)
    }


@dataclass(frozen=True)
class CallSite:
    file: str
    first_line: int
    last_line: int
    grant: Grant


def call_sites(entry: str = ENTRY) -> list[CallSite]:
    """Every kube.request / kube.watch / kube.list_all call in `entry`'s import closure, with
    the grant it needs.
    A call whose method or path cannot be read from the source fails the test: write it so it can."""
    sites = []
    for name in sorted(_closure(entry)):
        module = importlib.import_module(name)
        source = Path(module.__file__ or "")
        rel = str(source.relative_to(REPO))
        tree = ast.parse(source.read_text())
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            if not (
                isinstance(owner, ast.Name)
                and owner.id == "kube"
                and node.func.attr in ("request", "watch", "list_all")
            ):
                continue
            if node.func.attr == "watch":
                method, path_node = "WATCH", node.args[1]
            elif node.func.attr == "list_all":  # GETs of the collection, page by page
                method, path_node = "GET", node.args[1]
            else:
                method_node = node.args[1]
                assert isinstance(method_node, ast.Constant), (
                    f"{rel}:{node.lineno}: the method must be a literal"
                )
                method, path_node = str(method_node.value), node.args[2]
            path = _text(path_node, module, _assignments(node, parents))
            assert path is not None, (
                f"{rel}:{node.lineno}: the path must be a constant, an f-string or .format"
            )
            grant, _ = grant_for(method, path)
            sites.append(CallSite(rel, node.lineno, node.end_lineno or node.lineno, grant))
    return sites


def needed_grants() -> set[Grant]:
    direct = {
        s.grant
        for s in call_sites()
        if (s.file, s.grant.verb, s.grant.group, s.grant.resource) not in NOT_REACHED_BY_THE_PLUGIN
        and s.grant != PUBLIC_VERSION
    }
    # The API server's own rule (1.36+): a write of a claim's status.devices also needs the
    # synthetic `driver` subresource, for claims allocated on the caller's node.
    implied = {
        Grant(g.group, "resourceclaims/driver", f"associated-node:{g.verb}")
        for g in direct
        if g.resource == "resourceclaims/status" and g.verb in ("patch", "update")
    }
    return direct | implied


def granted(role: dict[str, Any]) -> set[Grant]:
    return {
        Grant(group, resource, verb)
        for rule in role["rules"]
        for group in rule.get("apiGroups", [])
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


# -- the chart on the real API server -----------------------------------------------------------


def render(helm: Helm, *sets: str) -> list[dict[str, Any]]:
    args = [a for s in sets for a in ("--set", s)]
    out = helm.run(
        "template", RELEASE, str(CHART), "-n", NAMESPACE, "--set", "namespace.create=true", *args
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@dataclass(frozen=True)
class AsDriver:
    """The chart's service account with a token bound to a pod on `node_a`."""

    api: client.ApiClient
    kubeconfig: Path
    node_a: str
    node_b: str


def _client(control_plane: ControlPlane, token: str) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = control_plane.server
    cfg.ssl_ca_cert = str(control_plane.ca_file)
    cfg.api_key = {"BearerToken": f"Bearer {token}"}
    return client.ApiClient(cfg)


@pytest.fixture(scope="module")
def chart(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return render(Helm(build_helm(), None, tmp_path_factory.mktemp("helm-home")))


@pytest.fixture(scope="module")
def as_driver(
    control_plane: ControlPlane,
    api: client.ApiClient,
    chart: list[dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[AsDriver]:
    kinds = (
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    )
    for doc in sorted((d for d in chart if d["kind"] in kinds), key=lambda d: kinds.index(d["kind"])):
        try:
            create_object(api, doc, NAMESPACE)
        except ApiException as e:
            if e.status != 409:
                raise
    suffix = uuid.uuid4().hex[:6]
    node_a, node_b = f"lp-a-{suffix}", f"lp-b-{suffix}"
    create_node(api, node_a)
    create_node(api, node_b)
    sa = f"{RELEASE}-gpu-dra-driver"
    pod = create_object(
        api,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"driver-{suffix}"},
            "spec": {
                "nodeName": node_a,
                "serviceAccountName": sa,
                "automountServiceAccountToken": False,
                "containers": [{"name": "c", "image": "driver"}],
            },
        },
        NAMESPACE,
    )
    token = sync_request(
        api,
        "POST",
        f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{sa}/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": 3600,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod["metadata"]["name"],
                    "uid": pod["metadata"]["uid"],
                },
            },
        },
    )["status"]["token"]
    kubeconfig = control_plane.write_kubeconfig(tmp_path_factory.mktemp("lp") / "kubeconfig", sa, token)
    driver = AsDriver(_client(control_plane, token), kubeconfig, node_a, node_b)
    # The policies take effect a moment after they are created: wait until one refuses.
    wait_for("the slice policy to refuse node B", lambda: _refusal(api, driver, _slice(node_b)), timeout=30)
    yield driver
    sync_request(
        api,
        "DELETE",
        f"/api/v1/namespaces/{NAMESPACE}/pods/{pod['metadata']['name']}",
        query={"gracePeriodSeconds": "0"},
    )
    for node in (node_a, node_b):
        delete_node_and_slices(api, node)


def _slice(node: str | None, driver: str = DRIVER, pool: str | None = None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": pool or node or "none", "generation": 1, "resourceSliceCount": 1},
        "devices": [{"name": "gpu-0"}],
        **spec,
    }
    if node is not None and not ({"allNodes", "nodeSelector"} & spec.keys()):
        body["nodeName"] = node
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"lp-{uuid.uuid4().hex[:8]}"},
        "spec": body,
    }


def _refusal(admin: client.ApiClient, driver: AsDriver, body: dict[str, Any]) -> str | None:
    """The policy's message for creating `body` as the driver; None (and the slice removed) if allowed."""
    try:
        sync_request(driver.api, "POST", SLICES, body)
    except ApiException as e:
        if e.status == 422:
            return str(e.body)
        raise
    sync_request(admin, "DELETE", f"{SLICES}/{body['metadata']['name']}")
    return None


def _status_of(call: Any) -> tuple[int, str]:
    try:
        call()
    except ApiException as e:
        return e.status, str(e.body)
    return 200, ""


# -- the tests ----------------------------------------------------------------------------------


def test_the_chart_grants_exactly_what_the_code_calls(
    chart: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    (role,) = [d for d in chart if d["kind"] == "ClusterRole"]
    # the driver's own API group (ComputeDomains) is a value: the source says "{group}"; its
    # grants are there only with computeDomains.enabled
    needed = needed_grants()
    need, have = {g for g in needed if g.group != "{}"}, granted(role)
    assert not need - have, f"the code calls what the chart does not grant: {sorted(need - have)}"
    assert not have - need, f"the chart grants what no code calls: {sorted(have - need)}"
    helm = Helm(build_helm(), None, tmp_path_factory.mktemp("helm-home"))
    with_domains = render(helm, "computeDomains.enabled=true")
    name = f"{RELEASE}-gpu-dra-driver"
    (role,) = [d for d in with_domains if d["kind"] == "ClusterRole" and d["metadata"]["name"] == name]
    need = {Grant(DRIVER if g.group == "{}" else g.group, g.resource, g.verb) for g in needed}
    have = granted(role)
    assert need == have, f"with ComputeDomains: missing {sorted(need - have)}; unused {sorted(have - need)}"
    assert not [d for d in chart if d["kind"] in ("Role", "RoleBinding")], "a Role the scan does not cover"
    by_driver = [r for r in role["rules"] if "resourceclaims/driver" in r["resources"]]
    assert all(r.get("resourceNames") == [DRIVER] for r in by_driver), by_driver


def test_the_compute_domain_controllers_role_grants_exactly_what_its_code_calls(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    helm = Helm(build_helm(), None, tmp_path_factory.mktemp("helm-home"))
    rendered = render(helm, "computeDomains.enabled=true")
    name = f"{RELEASE}-gpu-dra-driver-compute-domains"
    (role,) = [d for d in rendered if d["kind"] == "ClusterRole" and d["metadata"]["name"] == name]
    # the API group is the driver name, a value: the source says "{group}"
    need = {Grant(DRIVER if s.grant.group == "{}" else s.grant.group, s.grant.resource, s.grant.verb)
            for s in call_sites(CD_ENTRY)}
    have = granted(role)
    assert need and need == have, f"missing: {sorted(need - have)}; unused: {sorted(have - need)}"
    (binding,) = [d for d in rendered if d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"] == name]
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    assert binding["subjects"][0]["name"] == deployment["spec"]["template"]["spec"]["serviceAccountName"]


def test_the_scan_reads_every_api_call_of_the_plugin() -> None:
    """The scan finds the calls it must (a guard against the scan itself going blind)."""
    sites = {(s.file, s.grant) for s in call_sites()}
    assert ("dra_driver/plugin/claim_source.py", Grant("resource.k8s.io", "resourceclaims", "get")) in sites
    assert ("controller/reconciler.py", Grant("resource.k8s.io", "resourceslices", "watch")) in sites
    assert ("dra_driver/health/notify.py", Grant("", "events", "create")) in sites
    assert grant_for("PATCH", "/apis/resource.k8s.io/v1/namespaces/{}/resourceclaims/{}/status") == (
        Grant("resource.k8s.io", "resourceclaims/status", "patch"),
        True,
    )


def test_the_plugins_calls_run_through_the_charts_rbac_and_policies(
    api: client.ApiClient, as_driver: AsDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publisher, claim reads, recovery's list and health Events, in this process, as node A's
    token: nothing refused, and every call made comes from a call site the scan read."""
    calls: list[tuple[str, str, int, str, int]] = []  # method, path, status, file, line
    send = kube.ApiClient.send

    async def recording(
        self: kube.ApiClient, method: str, path: str, query: Any, payload: Any, content_type: str
    ) -> Any:
        response = await send(self, method, path, query, payload, content_type)
        frame = sys._getframe(1)
        while frame.f_code.co_filename.endswith("dra_driver/kube/__init__.py"):
            frame = frame.f_back  # type: ignore[assignment]
        verb = "WATCH" if (query or {}).get("watch") == "true" else method
        file = str(Path(frame.f_code.co_filename).relative_to(REPO))
        calls.append((verb, path, response.status, file, frame.f_lineno))
        return response

    monkeypatch.setattr(kube.ApiClient, "send", recording)
    ns = f"lp-{uuid.uuid4().hex[:6]}"
    create_namespace(api, ns)
    claim = create_object(
        api,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c"},
            "spec": {
                "devices": {
                    "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra-driver.dev"}}]
                }
            },
        },
        ns,
    )
    node_a = as_driver.node_a

    async def daemon_paths() -> None:
        api_ = await kube.load_client(str(as_driver.kubeconfig))
        try:
            ctl = await slice_controller(api_, DRIVER, {node_a: discover("l4x4")}, "auto")
            task = asyncio.create_task(ctl.run())
            await asyncio.wait_for(ctl.synced.wait(), 30)
            # A surplus slice in the pool (left by an older version): the publisher deletes it.
            surplus = _slice(node_a)
            surplus["metadata"]["name"] = f"{node_a}-{DRIVER}-099"
            create_object(api, surplus)
            # The publisher deletes the surplus first, then applies the slice it keeps: wait
            # for both before it is stopped.
            await wait_for_async(
                "the surplus slice deleted and the kept one applied",
                lambda: {"DELETE", "PATCH"} <= {c[0] for c in calls if "/resourceslices" in c[1]},
                timeout=10, detail=lambda: calls)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert ctl.stats.errors == 0, f"the publisher met {ctl.stats.errors} errors: {calls}"
            reader = ClaimReader(api_)
            ref = ClaimRef(namespace=ns, name="c", uid=claim["metadata"]["uid"])
            read = await reader.read([ref])
            assert isinstance(read[ref.uid], dict), read
            assert await reader.allocated_here(DRIVER, node_a) == []
            events = ClaimEvents(api_, DRIVER, node_a, lambda: asyncio.sleep(0, ()))
            await events._post(
                ClaimUse(ns, "c", claim["metadata"]["uid"], ("gpu-0",)),
                "DeviceUnhealthy",
                "a test",
                warning=True,
            )
            assert events.posted == 1
            status = ClaimStatus(api_, DRIVER, node_a, {}, {})
            status.unprepared(ref)  # releases the claim's status.devices entries: an apply
            await status.settled()
        finally:
            await api_.close()

    asyncio.run(daemon_paths())
    refused = [c for c in calls if c[2] in (401, 403, 422)]
    assert not refused, f"calls refused by the chart's RBAC or policies: {refused}"
    sites = call_sites()
    for verb, path, _, file, line in calls:
        grant, _ = grant_for(verb, path)
        # by file and grant: a call made through a coroutine handed to a retry helper runs
        # in the helper's frame, not at the line that built it
        read = sorted(str(s.grant) for s in sites if s.file == file)
        assert grant in {s.grant for s in sites if s.file == file}, (
            f"{verb} {path} from {file}:{line} needs {grant}; the scan read in that file only {read}"
        )
    made = {grant_for(c[0], c[1])[0] for c in calls}
    expected = (
        {
            Grant("resource.k8s.io", "resourceslices", v)
            for v in ("list", "watch", "create", "patch", "delete")
        }
        | {Grant("resource.k8s.io", "resourceclaims", v) for v in ("get", "list")}
        | {
            Grant("", "nodes", "get"),
            Grant("", "events", "create"),
            Grant("resource.k8s.io", "resourceclaims/status", "patch"),
            PUBLIC_VERSION,  # as the node's token: no grant of the chart's needed
        }
    )
    assert expected <= made, f"not exercised: {sorted(expected - made)}"


@pytest.mark.parametrize(
    ("what", "body", "message"),
    [
        ("node B's slice", lambda d: _slice(d.node_b), "may not write ResourceSlices of node {b}"),
        (
            "another driver's slice for node A",
            lambda d: _slice(d.node_a, driver="nic.example.com"),
            "may write only ResourceSlices of driver gpu.dra-driver.dev, not of nic.example.com",
        ),
        (
            "a slice for all nodes",
            lambda d: _slice(d.node_a, allNodes=True),
            "not ones with allNodes, nodeSelector or perDeviceNodeSelection",
        ),
        (
            "a slice with a node selector",
            lambda d: _slice(
                d.node_a,
                nodeSelector={
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [d.node_a]}]}
                    ]
                },
            ),
            "not ones with allNodes, nodeSelector or perDeviceNodeSelection",
        ),
        (
            "another pool on node A",
            lambda d: _slice(d.node_a, pool="elsewhere"),
            "may write only its own pool {a}, not pool elsewhere",
        ),
    ],
)
def test_the_driver_may_not_create(
    api: client.ApiClient, as_driver: AsDriver, what: str, body: Any, message: str
) -> None:
    refusal = _refusal(api, as_driver, body(as_driver))
    assert refusal is not None, f"{what} was allowed"
    print(f"{what}: {json.loads(refusal)['message']}")  # for reading: the closing note quotes them
    assert message.format(a=as_driver.node_a, b=as_driver.node_b) in refusal, refusal
    assert "ValidatingAdmissionPolicy" in refusal, refusal


def test_the_driver_may_not_touch_node_bs_slice_nor_claims(
    api: client.ApiClient, as_driver: AsDriver
) -> None:
    theirs = create_object(api, _slice(as_driver.node_b))
    path = f"{SLICES}/{theirs['metadata']['name']}"
    tainted = {
        **theirs,
        "spec": {
            **theirs["spec"],
            "devices": [{"name": "gpu-0", "taints": [{"key": "evil", "value": "x", "effect": "NoExecute"}]}],
        },
    }
    status, body = _status_of(lambda: sync_request(as_driver.api, "PUT", path, tainted))
    assert (status, f"may not write ResourceSlices of node {as_driver.node_b}" in body) == (422, True), body
    status, body = _status_of(lambda: sync_request(as_driver.api, "DELETE", path))
    assert (status, f"may not write ResourceSlices of node {as_driver.node_b}" in body) == (422, True), body
    sync_request(api, "DELETE", path)

    ns = f"lp-{uuid.uuid4().hex[:6]}"
    create_namespace(api, ns)
    create_object(
        api,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c"},
            "spec": {
                "devices": {
                    "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra-driver.dev"}}]
                }
            },
        },
        ns,
    )
    status_path = CLAIMS.format(ns=ns) + "/c/status"
    status, body = _status_of(
        lambda: sync_request(
            as_driver.api,
            "PUT",
            status_path,
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": "c", "namespace": ns},
                "status": {"devices": []},
            },
        )
    )
    assert status == 403 and "resourceclaims/status" in body, body
    status, body = _status_of(lambda: sync_request(as_driver.api, "GET", f"/api/v1/namespaces/{ns}/secrets"))
    assert status == 403, body


def test_the_driver_owns_its_own_slice(api: client.ApiClient, as_driver: AsDriver) -> None:
    mine = sync_request(as_driver.api, "POST", SLICES, _slice(as_driver.node_a))
    path = f"{SLICES}/{mine['metadata']['name']}"
    mine["spec"]["devices"][0]["taints"] = [{"key": "sick", "value": "x", "effect": "NoSchedule"}]
    updated = sync_request(as_driver.api, "PUT", path, mine)
    assert updated["spec"]["devices"][0]["taints"][0]["key"] == "sick"
    sync_request(as_driver.api, "DELETE", path)


def test_the_driver_posts_only_its_own_kind_of_event(api: client.ApiClient, as_driver: AsDriver) -> None:
    ns = f"lp-{uuid.uuid4().hex[:6]}"
    create_namespace(api, ns)

    def event(kind: str, node: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": "e.", "namespace": ns},
            "involvedObject": {"apiVersion": "v1", "kind": kind, "namespace": ns, "name": "x"},
            "reason": "DeviceUnhealthy",
            "message": "m",
            "type": "Warning",
            "source": {"component": DRIVER, "host": node},
            "reportingComponent": DRIVER,
            "reportingInstance": node,
        }

    path = f"/api/v1/namespaces/{ns}/events"
    status, body = _status_of(
        lambda: sync_request(as_driver.api, "POST", path, event("Secret", as_driver.node_a))
    )
    assert status == 422 and "only about ResourceClaims, Pods and its own Node" in body, body
    # an Event about a Node (cluster-scoped) lives in `default`, as the publisher posts it
    node_path = "/api/v1/namespaces/default/events"
    in_default = {"generateName": "e.", "namespace": "default"}
    other_node = {**event("Node", as_driver.node_a), "metadata": in_default}
    other_node["involvedObject"] = {"apiVersion": "v1", "kind": "Node", "name": as_driver.node_b}
    status, body = _status_of(lambda: sync_request(as_driver.api, "POST", node_path, other_node))
    assert status == 422 and "only about ResourceClaims, Pods and its own Node" in body, body
    # its own Node: a feature the server cannot carry (DRAFeatureOff, controller/publisher.py)
    own_node = {**other_node, "involvedObject": {**other_node["involvedObject"], "name": as_driver.node_a}}
    sync_request(as_driver.api, "POST", node_path, own_node)
    status, body = _status_of(
        lambda: sync_request(as_driver.api, "POST", path, event("Pod", as_driver.node_b))
    )
    assert (
        status == 422 and "may post only Events reported by gpu.dra-driver.dev from its own node" in body
    ), body
    sync_request(as_driver.api, "POST", path, event("Pod", as_driver.node_a))


def test_the_driver_writes_only_its_own_entries_of_a_claims_status(
    api: client.ApiClient, as_driver: AsDriver
) -> None:
    """RBAC lets the driver patch claim status (status.devices); the policy keeps it to the
    entries of its own driver and node's pool, and away from the allocation."""
    ns = f"lp-{uuid.uuid4().hex[:6]}"
    create_namespace(api, ns)
    request = {"name": "gpu", "exactly": {"deviceClassName": "gpu.dra-driver.dev", "count": 2}}
    claim = create_object(
        api,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c"},
            "spec": {"devices": {"requests": [request]}},
        },
        ns,
    )
    path = CLAIMS.format(ns=ns) + "/c/status"
    results = [
        {"request": "gpu", "driver": DRIVER, "pool": node, "device": "gpu-0"}
        for node in (as_driver.node_a, as_driver.node_b)
    ]
    on_a = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [as_driver.node_a]}]}
    claim["status"] = {
        "allocation": {"devices": {"results": results}, "nodeSelector": {"nodeSelectorTerms": [on_a]}}
    }
    sync_request(api, "PUT", path, claim)

    def apply(status: dict[str, Any]) -> tuple[int, str]:
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"namespace": ns, "name": "c"},
            "status": status,
        }

        async def send() -> tuple[int, str]:
            driver_api = await kube.load_client(str(as_driver.kubeconfig))
            try:
                await kube.request(
                    driver_api,
                    "PATCH",
                    path,
                    body=body,
                    content_type="application/apply-patch+yaml",
                    query={"fieldManager": "lp-test", "force": "true"},
                )
            except kube.ApiException as e:
                return e.status, e.body
            finally:
                await driver_api.close()
            return 200, ""

        return asyncio.run(send())

    def entry(node: str) -> dict[str, Any]:
        return {"driver": DRIVER, "pool": node, "device": "gpu-0"}

    status, body = apply({"devices": [entry(as_driver.node_b)]})
    wanted = f"may change only the status.devices entries of driver {DRIVER} in pool {as_driver.node_a}"
    assert (status, wanted in body) == (422, True), body
    status, body = apply({"allocation": {"devices": {"results": results[:1]}}})
    assert (status, "resourceclaims/binding" in body and "requires resource=" in body) == (422, True), body
    status, body = apply({"devices": [entry(as_driver.node_a)]})
    assert status == 200, body
    written = sync_request(api, "GET", CLAIMS.format(ns=ns) + "/c")["status"]["devices"]
    assert [(d["pool"], d["device"]) for d in written] == [(as_driver.node_a, "gpu-0")]
