"""`dra-driver claim --linked K`: which shape it picks for a fleet, and what it prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from controller.attributes import LINKED_SET_ATTRIBUTES, MIG_ENABLED, TYPE
from controller.claim_fit import fit_linked_claim
from controller.claim_shapes import fits_selector, linked_class
from controller.slices import SliceFeatures, desired_slices, published_topology
from dra_driver.commands import claim as claim_cmd
from dra_driver.gpu import discover, profile_names
from tests.harness.topologies import random_profile

DRIVER = "gpu.dra-driver.dev"
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
GA = SliceFeatures(list_attributes=False)
LISTS = SliceFeatures(list_attributes=True)


def fleet(features: SliceFeatures, *profiles: str) -> list[dict[str, Any]]:
    return [{"spec": s} for i, p in enumerate(profiles)
            for s in desired_slices(discover(p), f"node-{i}", DRIVER, features)]


def subrequests(devices: dict[str, Any]) -> list[str]:
    (request,) = devices["requests"]
    return [s["name"] for s in request.get("firstAvailable", [])] or [request["name"]]


@pytest.mark.parametrize("features", [GA, LISTS], ids=["ga", "list-attrs"])
@pytest.mark.parametrize("k", [2, 3, 8])
def test_nvswitch_fleet_gets_one_layer(features: SliceFeatures, k: int) -> None:
    fitted = fit_linked_claim(k, fleet(features, "hgx-h200", "hgx-h200"))
    assert (fitted.form, fitted.layers, fitted.nodes, fitted.nodes_that_fit) == ("layers", (0,), 2, 2)
    assert subrequests(fitted.devices) == ["layer0"]
    # every node holds k linked GPUs: the fail-fast selector would drop nothing, only cost
    assert "selectors" not in fitted.devices["requests"][0]["firstAvailable"][0]


def test_the_list_form_from_three_layers_where_served(tmp_path: Any) -> None:
    """Cube-mesh pairs need 2 layers: the layers, with or without list attributes; random-5's
    pairs need 7: the list form where it is served (LIST_FORM_FROM_LAYERS)."""
    for features in (GA, LISTS):
        pairs = fit_linked_claim(2, fleet(features, "dgx1-v100"))
        assert (pairs.form, subrequests(pairs.devices)) == ("layers", ["layer0", "layer1"])
    seven = str(random_profile(5, tmp_path))
    listed = fit_linked_claim(2, fleet(LISTS, seven))
    assert listed.form == "list" and len(listed.layers) == 7
    constraint = {"requests": ["gpus"], "matchAttribute": f"{DRIVER}/nvlinkCliques"}
    assert listed.devices["constraints"] == [constraint]
    assert fit_linked_claim(2, fleet(GA, seven)).form == "layers"
    quad = fit_linked_claim(4, fleet(LISTS, "dgx1-v100"))
    assert (quad.form, subrequests(quad.devices)) == ("layers", ["layer0"])


def test_a_fleet_without_k_linked_gpus_says_the_claim_stays_pending() -> None:
    fitted = fit_linked_claim(3, fleet(GA, "ring8-v100", "dgx1-v100"), device_class=DRIVER)
    assert fitted.nodes_that_fit == 1 and fitted.layers == (0,)
    sub = fitted.devices["requests"][0]["firstAvailable"][0]
    assert sub["selectors"] == [{"cel": {"expression": fits_selector(3)}}]  # the ring fails fast
    none = fit_linked_claim(5, fleet(GA, "ring8-v100", "dgx1-v100"))
    assert none.nodes_that_fit == 0 and "stays Pending" in none.note
    assert subrequests(none.devices) == ["layer0"]
    # the shipped class has no selector; the claim gets the fail-fast one, as the DGX-1's groups
    # of 4 are dear to search (SEARCH_BOUND_GROUP), but no 3 on a ring with pairs only
    assert none.devices["requests"][0]["firstAvailable"][0]["deviceClassName"] == f"gpu-linked.{DRIVER}"
    assert none.devices["requests"][0]["firstAvailable"][0]["selectors"] == [
        {"cel": {"expression": fits_selector(5)}}]
    ring = fit_linked_claim(3, fleet(GA, "ring8-v100")).devices["requests"][0]["firstAvailable"][0]
    assert "selectors" not in ring
    listed = fit_linked_claim(3, fleet(LISTS, "ring8-v100", "dgx1-v100"))
    assert listed.form == "layers"  # one layer: no need for the list form
    pairs = fit_linked_claim(2, fleet(LISTS, "ring8-v100", "dgx1-v100")).devices["requests"][0]
    assert "selectors" not in pairs["firstAvailable"][0]  # every node has a linked pair


def test_a_mixed_fleet_lists_the_layers_of_every_node(tmp_path: Any) -> None:
    path = str(random_profile(5, tmp_path))  # largest clique 4, 7 layers
    fitted = fit_linked_claim(2, fleet(GA, "hgx-h200", path))
    assert fitted.form == "layers" and len(fitted.layers) > 1 and fitted.layers[0] == 0


def test_one_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="2 or more"):
        fit_linked_claim(1, fleet(GA, "hgx-h200"))


def test_the_command_prints_a_template_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    slices = fleet(LISTS, "dgx1-v100")

    async def read(kubeconfig: str | None, driver: str) -> list[dict[str, Any]]:
        return slices

    served = {f"gpu-linked.{DRIVER}"}

    async def exists(kubeconfig: str | None, name: str) -> bool:
        return name in served

    monkeypatch.setattr(claim_cmd, "read_slices", read)
    monkeypatch.setattr(claim_cmd, "class_served", exists)
    result = CliRunner().invoke(claim_cmd.claim, ["--linked", "4", "--selector", "true", "-n", "ml"])
    assert result.exit_code == 0, result.output
    template = yaml.safe_load(result.stdout)
    assert template["metadata"] == {"name": "linked-4-gpus", "namespace": "ml"}
    assert template["spec"]["spec"]["devices"] == fit_linked_claim(4, slices, selectors=["true"]).devices
    assert "1 of 1 nodes can hold 4 linked GPUs" in result.stderr
    # a cluster without the linked classes (deviceClasses.linked off): the whole-GPU class
    served.clear()
    plain = CliRunner().invoke(claim_cmd.claim, ["--linked", "4"])
    assert plain.exit_code == 0, plain.output
    assert "not found" in plain.stderr
    sub = yaml.safe_load(plain.stdout)["spec"]["spec"]["devices"]["requests"][0]["firstAvailable"][0]
    assert sub["deviceClassName"] == DRIVER
    monkeypatch.setattr(claim_cmd, "read_slices", lambda *a: _none())
    empty = CliRunner().invoke(claim_cmd.claim, ["--linked", "2"])
    assert empty.exit_code != 0 and "no ResourceSlices" in empty.output


@pytest.mark.parametrize("features", [GA, LISTS], ids=["ga", "list-attrs"])
def test_a_node_with_no_linked_gpu_does_not_hide_the_servers_list_attributes(
    monkeypatch: pytest.MonkeyPatch, features: SliceFeatures
) -> None:
    """A one-GPU node publishes no nvlinkCliques, list-type attributes served or not: the
    command reads whether the server keeps them from the fleet, not from that node."""
    slices = fleet(features, "dgx1-v100", "h200-single")

    async def read(kubeconfig: str | None, driver: str) -> list[dict[str, Any]]:
        return slices

    async def exists(kubeconfig: str | None, name: str) -> bool:
        return True

    monkeypatch.setattr(claim_cmd, "read_slices", read)
    monkeypatch.setattr(claim_cmd, "class_served", exists)
    result = CliRunner().invoke(claim_cmd.claim, ["--linked", "3"])
    assert result.exit_code == 0, result.output
    assert "1 of 2 nodes can hold 3 linked GPUs" in result.stderr
    assert ("the server keeps no list-type attributes" in result.stderr) == (features is GA), result.stderr
    assert claim_cmd.lists_kept(slices, DRIVER) == (features is LISTS)


def test_the_help_names_the_linked_class_that_exists() -> None:
    text = CliRunner().invoke(claim_cmd.claim, ["--help"]).output + (claim_cmd.__doc__ or "")
    assert "gpu-linked-K" not in text
    shipped = yaml.safe_load((DEPLOY / "deviceclasses" / "gpu-linked.yaml").read_text())["metadata"]["name"]
    assert shipped == linked_class(DRIVER) and "gpu-linked.<driver name>" in " ".join(text.split())


async def _none() -> list[dict[str, Any]]:
    return []


@pytest.mark.parametrize("features", [GA, LISTS], ids=["ga", "list-attrs"])
@pytest.mark.parametrize("k", [2, 3, 4, 8, 9])
def test_the_generated_claim_names_the_linked_class_and_no_selector(features: SliceFeatures, k: int) -> None:
    """The selector-free class, and no selector (any selector costs the scheduler a copy of the
    device's attributes per device it looks at) unless a node that cannot hold k has a linked
    group of SEARCH_BOUND_GROUP or more, whose subsets the scheduler's search would go through:
    here the DGX-1 node's 4 for k = 5 to 8, the HGX node's 8 for k = 9."""
    fitted = fit_linked_claim(k, fleet(features, "ring8-v100", "dgx1-v100", "hgx-h200"))
    (request,) = fitted.devices["requests"]
    for sub in request.get("firstAvailable") or [request["exactly"]]:
        assert sub["deviceClassName"] == f"gpu-linked.{DRIVER}"
        assert sub.get("selectors") == ([{"cel": {"expression": fits_selector(k)}}] if k > 4 else None)
    # with a class of one's own, the fail-fast test goes into the claim where some node cannot hold k
    own = fit_linked_claim(k, fleet(features, "ring8-v100"), device_class="mine").devices["requests"][0]
    sub = (own.get("firstAvailable") or [own["exactly"]])[0]
    assert sub["deviceClassName"] == "mine"
    if k > 2:  # a ring's largest linked set is 2
        assert sub["selectors"] == [{"cel": {"expression": fits_selector(k)}}]
    else:
        assert "selectors" not in sub


def test_the_shipped_linked_class_is_the_one_the_generator_names_and_has_no_selector() -> None:
    """deploy/deviceclasses/gpu-linked.yaml holds one class, claim_shapes.linked_class(), with
    no selector: the claims' constraint does the selecting (docs/nvlink.md)."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "deviceclasses" / "gpu-linked.yaml").read_text()) if d]
    assert [(d["kind"], d["metadata"]["name"], d["spec"]) for d in docs] == [
        ("DeviceClass", linked_class(DRIVER), {})]


_FEATURES = {
    "ga": GA, "lists": LISTS, "legacy": SliceFeatures(legacy_attributes=True),
    "shares": SliceFeatures(memory_shares=True, list_attributes=True),
    "shares-only": SliceFeatures(memory_shares=True, shares_only=True),
    "dynamic-mig": SliceFeatures(dynamic_mig=True, list_attributes=True),
}


@pytest.mark.parametrize("features", list(_FEATURES.values()), ids=list(_FEATURES))
@pytest.mark.parametrize("profile", profile_names())
def test_only_whole_gpus_not_in_mig_mode_carry_a_clique_attribute(
    profile: str, features: SliceFeatures
) -> None:
    """What the selector-free gpu-linked class rests on: a device with any attribute a linked
    claim may constrain on is a whole GPU not in MIG mode (no share view, MIG device or
    partition). It fails where a share view copies its GPU's attributes."""
    carriers = 0
    inventory = discover(profile)
    for spec in desired_slices(inventory, "n", DRIVER, features):
        for device in spec.get("devices", []):
            attrs = device.get("attributes", {})
            if LINKED_SET_ATTRIBUTES & set(attrs):
                carriers += 1
                assert attrs[TYPE] == {"string": "gpu"} and MIG_ENABLED not in attrs, device["name"]
    # the test looks at something: where the node has linked whole GPUs, they carry the attributes
    assert carriers or not published_topology(inventory).cliques or features.shares_only
