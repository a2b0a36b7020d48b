"""ComputeDomains against the real API server, garbage collector and `dra-driver
compute-domain-controller`: the CRD as the chart renders it (its validation is the API
server's), each domain's workload ResourceClaimTemplate, its status from the nodes that
joined, and nothing left when it is deleted. The tests play the nodes' part (status.nodes).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from controller import compute_domains as cd
from tests.harness.cluster import ControlPlane
from tests.harness.compute_domains import compute_domain_controller, domain, domains_path
from tests.harness.driver import DRIVER
from tests.harness.nvidia_reference import nvidia_source
from tests.harness.objects import api_error, sync_request, wait_for

TEMPLATES = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates"


@pytest.fixture(scope="module")
def controller(control_plane: ControlPlane, api: client.ApiClient) -> Iterator[subprocess.Popen[bytes]]:
    with compute_domain_controller(control_plane, api) as proc:
        yield proc


def create(api: client.ApiClient, ns: str, body: dict[str, Any]) -> dict[str, Any]:
    return sync_request(api, "POST", domains_path(DRIVER, ns), body)


def template(api: client.ApiClient, ns: str, name: str) -> dict[str, Any] | None:
    try:
        return sync_request(api, "GET", f"{TEMPLATES.format(ns=ns)}/{name}")
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def test_a_domain_gets_its_channel_template_owned_by_it(
    controller: subprocess.Popen[bytes], api: client.ApiClient, namespace: str
) -> None:
    made = create(api, namespace, domain("job", "job-channel", numNodes=4))
    assert made["spec"]["channel"]["allocationMode"] == "Single"  # the CRD's default, as NVIDIA's
    got = wait_for("the domain's template", lambda: template(api, namespace, "job-channel"))
    (request,) = got["spec"]["spec"]["devices"]["requests"]
    assert request == {"name": "channel", "exactly": {"deviceClassName": cd.channel_class(DRIVER),
                                                      "allocationMode": "ExactCount", "count": 1}}
    (config,) = got["spec"]["spec"]["devices"]["config"]
    assert config["opaque"]["driver"] == cd.channel_driver(DRIVER)
    assert config["opaque"]["parameters"] == {
        "apiVersion": cd.api_version(DRIVER), "kind": "ComputeDomainChannelConfig",
        "domainID": made["metadata"]["uid"], "allocationMode": "Single",
    }
    (owner,) = got["metadata"]["ownerReferences"]
    assert (owner["uid"], owner["controller"]) == (made["metadata"]["uid"], True)


def test_status_is_ready_once_numnodes_nodes_joined_and_each_is_ready(
    controller: subprocess.Popen[bytes], api: client.ApiClient, namespace: str
) -> None:
    create(api, namespace, domain("pair", "pair-channel", numNodes=2))
    path = f"{domains_path(DRIVER, namespace)}/pair"

    def status() -> str | None:
        got: str | None = (sync_request(api, "GET", path).get("status") or {}).get("status")
        return got

    def nodes(*entries: tuple[str, str]) -> None:
        body = {"status": {"nodes": [
            {"name": n, "ipAddress": f"10.0.0.{i}", "cliqueID": "c.1", "index": i, "status": s}
            for i, (n, s) in enumerate(entries)
        ]}}
        sync_request(api, "PATCH", f"{path}/status", body, content_type="application/merge-patch+json")

    wait_for("NotReady with no node", lambda: status() == "NotReady")
    nodes(("n0", "Ready"))
    wait_for("still NotReady with 1 of 2 nodes", lambda: status() == "NotReady")
    nodes(("n0", "Ready"), ("n1", "NotReady"))
    nodes(("n0", "Ready"), ("n1", "Ready"))
    wait_for("Ready with both nodes ready", lambda: status() == "Ready")
    nodes(("n0", "Ready"), ("n1", "NotReady"))
    wait_for("NotReady again when a node is not", lambda: status() == "NotReady")


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ({"channel": {"resourceClaimTemplate": {"name": "t"}, "allocationMode": "Some"}}, "allocationMode"),
        ({"numNodes": 1}, "channel"),
        ({"channel": {"resourceClaimTemplate": {"name": "Not_A_Name"}}}, "name"),
        ({"channel": {"resourceClaimTemplate": {"name": "t"}}, "numNodes": -1}, "numNodes"),
    ],
)
def test_the_api_server_refuses_what_nvidias_crd_refuses(
    controller: subprocess.Popen[bytes],
    api: client.ApiClient,
    namespace: str,
    spec: dict[str, Any],
    fragment: str,
) -> None:
    body = {"apiVersion": cd.api_version(DRIVER), "kind": "ComputeDomain", "metadata": {"name": "bad"},
            "spec": spec}
    with pytest.raises(ApiException) as refused:
        create(api, namespace, body)
    assert refused.value.status == 422 and fragment in api_error(refused.value), api_error(refused.value)


def test_the_spec_cannot_change(
    controller: subprocess.Popen[bytes], api: client.ApiClient, namespace: str
) -> None:
    create(api, namespace, domain("fixed", "fixed-channel"))
    patch = {"spec": {"numNodes": 3}}
    with pytest.raises(ApiException) as refused:
        sync_request(api, "PATCH", f"{domains_path(DRIVER, namespace)}/fixed", patch,
                     content_type="application/merge-patch+json")
    assert "immutable" in api_error(refused.value)


def test_deleting_a_domain_leaves_no_template(
    controller: subprocess.Popen[bytes], api: client.ApiClient, namespace: str
) -> None:
    create(api, namespace, domain("gone", "gone-channel"))
    wait_for("the domain's template", lambda: template(api, namespace, "gone-channel"))
    sync_request(api, "DELETE", f"{domains_path(DRIVER, namespace)}/gone")
    wait_for("the template garbage-collected", lambda: template(api, namespace, "gone-channel") is None,
             timeout=60)


def test_a_template_name_another_owner_holds_is_left_alone_and_said(
    controller: subprocess.Popen[bytes], api: client.ApiClient, namespace: str
) -> None:
    mine = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "taken"},
            "spec": {"spec": {"devices": {"requests": [{"name": "x", "exactly": {"deviceClassName": "x"}}]}}}}
    sync_request(api, "POST", TEMPLATES.format(ns=namespace), mine)
    create(api, namespace, domain("late", "taken"))

    def warned() -> list[dict[str, Any]]:
        events = sync_request(api, "GET", f"/api/v1/namespaces/{namespace}/events")["items"]
        return [e for e in events if e["reason"] == "TemplateTaken" and e["involvedObject"]["name"] == "late"]

    (event,) = wait_for("a TemplateTaken Event on the domain", warned)
    assert "spec.channel.resourceClaimTemplate.name" in event["message"]
    kept = template(api, namespace, "taken")
    assert kept is not None and kept["spec"]["spec"]["devices"]["requests"][0]["name"] == "x"
    assert not kept["metadata"].get("ownerReferences")


# NVIDIA's manifests, changed as docs/compute-domains.md says (the test reads the sed from there)
SED = re.compile(r"^sed -e '(?P<expression>[^']+)'", re.M)


@pytest.mark.parametrize(("spec", "mode"), [("channel-injection.yaml", "Single"),
                                            ("channel-injection-all.yaml", "All")])
def test_nvidias_compute_domain_examples_get_their_templates_after_the_documented_sed(
    controller: subprocess.Popen[bytes], api: client.ApiClient, namespace: str, spec: str, mode: str
) -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "compute-domains.md").read_text()
    match = SED.search(docs)
    assert match, "docs/compute-domains.md has no sed line"
    source = nvidia_source() / "demo" / "specs" / "imex" / spec
    changed = subprocess.run(["sed", "-e", match.group("expression"), str(source)], capture_output=True,
                             text=True, check=True).stdout
    (written,) = [d for d in yaml.safe_load_all(changed) if d and d["kind"] == "ComputeDomain"]
    assert written["apiVersion"] == cd.api_version(DRIVER)
    made = create(api, namespace, written)
    name = written["spec"]["channel"]["resourceClaimTemplate"]["name"]
    got = wait_for("the example's template", lambda: template(api, namespace, name))
    (config,) = got["spec"]["spec"]["devices"]["config"]
    assert config["opaque"]["parameters"]["allocationMode"] == mode
    assert config["opaque"]["parameters"]["domainID"] == made["metadata"]["uid"]
