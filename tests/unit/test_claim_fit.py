"""`dra-driver claim --linked K`: which shape it picks for a fleet, and what it prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from controller.claim_fit import fit_linked_claim
from controller.claim_shapes import LINKED_CLASS_KS, fits_selector, linked_class, linked_class_selector
from controller.slices import SliceFeatures, desired_slices
from dra_driver.commands import claim as claim_cmd
from dra_driver.gpu import discover
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


def test_cube_mesh_pairs_take_the_list_form_where_served_else_two_layers() -> None:
    listed = fit_linked_claim(2, fleet(LISTS, "dgx1-v100"))
    assert (listed.form, listed.layers) == ("list", (0, 1))
    constraint = {"requests": ["gpus"], "matchAttribute": f"{DRIVER}/nvlinkCliques"}
    assert listed.devices["constraints"] == [constraint]
    ga = fit_linked_claim(2, fleet(GA, "dgx1-v100"))
    assert (ga.form, subrequests(ga.devices)) == ("layers", ["layer0", "layer1"])
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
    # the shipped class carries the fail-fast test: no second expression in the claim
    assert none.devices["requests"][0]["firstAvailable"][0]["deviceClassName"] == f"gpu-linked-5.{DRIVER}"
    assert "selectors" not in none.devices["requests"][0]["firstAvailable"][0]
    listed = fit_linked_claim(3, fleet(LISTS, "ring8-v100", "dgx1-v100"))
    assert listed.form == "layers"  # one layer: no need for the list form
    assert fit_linked_claim(2, fleet(LISTS, "ring8-v100", "dgx1-v100")).devices["requests"][0]["exactly"].get(
        "selectors") is None  # every node has a linked pair


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

    served = {f"gpu-linked-4.{DRIVER}"}

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


async def _none() -> list[dict[str, Any]]:
    return []


@pytest.mark.parametrize("features", [GA, LISTS], ids=["ga", "list-attrs"])
@pytest.mark.parametrize("k", range(2, 9))
def test_the_generated_claim_names_the_linked_class_and_no_selector(features: SliceFeatures, k: int) -> None:
    fitted = fit_linked_claim(k, fleet(features, "ring8-v100", "dgx1-v100", "hgx-h200"))
    (request,) = fitted.devices["requests"]
    for sub in request.get("firstAvailable") or [request["exactly"]]:
        assert sub["deviceClassName"] == f"gpu-linked-{k}.{DRIVER}" and "selectors" not in sub
    # above the shipped classes, and with a class of one's own: the selector in the claim
    nine = fit_linked_claim(9, fleet(features, "ring8-v100")).devices["requests"][0]["firstAvailable"][0]
    assert nine["deviceClassName"] == DRIVER
    assert nine["selectors"] == [{"cel": {"expression": fits_selector(9)}}]
    own = fit_linked_claim(k, fleet(features, "hgx-h200"), device_class="mine").devices["requests"][0]
    assert own["firstAvailable"][0]["deviceClassName"] == "mine"


def test_the_shipped_linked_classes_are_the_ones_the_generator_names() -> None:
    """deploy/deviceclasses/gpu-linked.yaml and the chart's deviceClasses.linked render the same
    classes, whose selector is claim_shapes.linked_class_selector(k)."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "deviceclasses" / "gpu-linked.yaml").read_text()) if d]
    shipped = {d["metadata"]["name"]: " ".join(d["spec"]["selectors"][0]["cel"]["expression"].split())
               for d in docs}
    assert shipped == {linked_class(k, DRIVER): linked_class_selector(k, DRIVER) for k in LINKED_CLASS_KS}
    whole = yaml.safe_load((DEPLOY / "deviceclasses" / "gpu.yaml").read_text())
    # the whole-GPU class's test, and the clique size: nothing else
    assert set(linked_class_selector(3).split(" && ")) == {
        *" ".join(whole["spec"]["selectors"][0]["cel"]["expression"].split()).split(" && "), fits_selector(3)}
