"""The GA claim shape with only the layers a fleet can use (`fleet_layers`) finds exactly what the
full 8-layer shape finds: the same GPUs through the same subrequest, for every busy set and every k.

The allocator model is tests/unit/test_nvlink_model.py's (first k-subset in device order
whose values match, subrequests in order), checked there against brute force.
"""

from __future__ import annotations

import pytest

from controller.claim_shapes import fleet_layers, linked_gpus_ga
from controller.slices import desired_slices, published_topology
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.gpu import discover, profile_names
from dra_driver.gpu.model import Inventory
from tests.unit.test_nvlink_model import GENERATED, OFF, FastModel, busy_sets, class_devices, graph_inventory

CASES = [*sorted(profile_names()), "ring-5", "bridged-triangles", "mesh-2x3", "apex-over-K3,2,2"]


def _inventory(name: str) -> Inventory:
    return graph_inventory(*GENERATED[name]) if name in GENERATED else discover(simulate=name)


@pytest.mark.parametrize("name", CASES)
def test_the_fitted_shape_finds_what_the_full_shape_finds(name: str) -> None:
    inv = _inventory(name)
    devices = class_devices(desired_slices(inv, "node-1", DRIVER, OFF))
    whole = sorted(d.index for d in devices)
    topology = published_topology(inv)
    for k in range(2, len(whole) + 1):
        layers = fleet_layers(k, [topology])
        assert len(layers) <= max(len(topology.clique_layers.layers), 1)
        full = FastModel.build(devices, linked_gpus_ga(k), list_semantics=False)
        fitted = FastModel.build(devices, linked_gpus_ga(k, layers=layers), list_semantics=False)
        for busy in busy_sets(whole):
            assert fitted.allocate(busy) == full.allocate(busy), (name, k, sorted(busy), layers)


def test_fleet_layers_of_the_benchmark_fleets() -> None:
    hgx, dgx1 = (published_topology(discover(simulate=p)) for p in ("hgx-h200", "dgx1-v100"))
    assert fleet_layers(2, [hgx]) == (0,) and fleet_layers(8, [hgx]) == (0,)
    assert fleet_layers(2, [dgx1]) == (0, 1)  # the cube-mesh's pairs across the two quads: layer 1
    assert fleet_layers(4, [dgx1]) == (0,)
    assert fleet_layers(4, [hgx, dgx1]) == (0,) and fleet_layers(2, [hgx, dgx1]) == (0, 1)
    assert fleet_layers(2, []) == (0,)
    shape = linked_gpus_ga(4, layers=(0, 2))
    assert [s["name"] for s in shape["requests"][0]["firstAvailable"]] == ["layer0", "layer2"]
    assert [c["requests"] for c in shape["constraints"]] == [["gpus/layer0"], ["gpus/layer2"]]
    assert linked_gpus_ga(2, layers=8) == linked_gpus_ga(2)


@pytest.mark.parametrize("layers", [0, 9, (), (0, 0), (8,), (-1,)])
def test_bad_layers_are_refused_with_what_to_give(layers: int | tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"distinct layers of 0\.\.7"):
        linked_gpus_ga(2, layers=layers)
