"""The pure plan of the slice publisher (`controller.plan`): what to write for a pool, at which generation."""

from __future__ import annotations

import copy
from typing import Any

from controller.plan import PoolSpec, desired_objects, plan_pool, slice_name, up_to_date
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER

OWNER = {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "node-uid", "controller": True}


def _pool(*device_lists: list[str]) -> PoolSpec:
    specs = tuple({"driver": DRIVER, "devices": [{"name": d} for d in devs]} for devs in device_lists)
    return PoolSpec(name="n1", node_name="n1", slice_specs=specs)


def _as_stored(objects: dict[str, Any]) -> list[dict[str, Any]]:
    """What the API server would return for these objects (plus server-set metadata)."""
    stored = []
    for i, obj in enumerate(objects.values()):
        o = copy.deepcopy(obj)
        o["metadata"].update(uid=f"uid-{i}", resourceVersion=str(100 + i))
        stored.append(o)
    return stored


def test_nothing_to_do_when_the_server_has_what_we_want() -> None:
    pool = _pool(["gpu-0", "gpu-1"], ["gpu-2"])
    plan = plan_pool(DRIVER, pool, _as_stored(desired_objects(DRIVER, pool, 3, OWNER)), OWNER)
    assert (plan.apply, plan.delete, plan.generation) == ((), (), 3)


def test_empty_pool_creates_all_at_generation_one() -> None:
    pool = _pool(["gpu-0"], ["gpu-1"])
    plan = plan_pool(DRIVER, pool, [], OWNER)
    assert plan.generation == 1
    assert [o["metadata"]["name"] for o in plan.apply] == [
        slice_name(DRIVER, "n1", 0),
        slice_name(DRIVER, "n1", 1),
    ]
    assert all(
        o["spec"]["pool"] == {"name": "n1", "generation": 1, "resourceSliceCount": 2} for o in plan.apply
    )
    assert all(
        o["spec"]["nodeName"] == "n1" and o["metadata"]["ownerReferences"] == [OWNER] for o in plan.apply
    )


def test_one_edited_slice_is_repaired_in_place_at_the_same_generation() -> None:
    pool = _pool(["gpu-0"], ["gpu-1"])
    stored = _as_stored(desired_objects(DRIVER, pool, 4, OWNER))
    stored[1]["spec"]["devices"][0]["attributes"] = {"handEdited": {"string": "yes"}}
    plan = plan_pool(DRIVER, pool, stored, OWNER)
    assert plan.generation == 4 and plan.delete == ()
    assert [o["metadata"]["name"] for o in plan.apply] == [stored[1]["metadata"]["name"]]
    assert plan.apply[0]["spec"]["devices"] == [{"name": "gpu-1"}]


def test_a_missing_slice_bumps_the_generation_and_rewrites_all() -> None:
    pool = _pool(["gpu-0"], ["gpu-1"])
    stored = _as_stored(desired_objects(DRIVER, pool, 4, OWNER))[:1]
    plan = plan_pool(DRIVER, pool, stored, OWNER)
    assert plan.generation == 5
    assert len(plan.apply) == 2 and all(o["spec"]["pool"]["generation"] == 5 for o in plan.apply)


def test_slices_no_longer_wanted_are_deleted() -> None:
    stored = _as_stored(desired_objects(DRIVER, _pool(["gpu-0"], ["gpu-1"], ["gpu-2"]), 2, OWNER))
    plan = plan_pool(DRIVER, _pool(["gpu-0", "gpu-1", "gpu-2"]), stored, OWNER)
    assert plan.generation == 3
    assert [o["metadata"]["name"] for o in plan.delete] == [
        stored[1]["metadata"]["name"],
        stored[2]["metadata"]["name"],
    ]
    assert plan.apply[0]["spec"]["pool"]["resourceSliceCount"] == 1


def test_mixed_generations_are_rewritten() -> None:
    pool = _pool(["gpu-0"], ["gpu-1"])
    stored = _as_stored(desired_objects(DRIVER, pool, 2, OWNER))
    stored[0]["spec"]["pool"]["generation"] = 1
    plan = plan_pool(DRIVER, pool, stored, OWNER)
    assert plan.generation == 3 and len(plan.apply) == 2


def test_up_to_date_checks_labels_and_owner_too() -> None:
    pool = _pool(["gpu-0"])
    (want,) = desired_objects(DRIVER, pool, 1, OWNER).values()
    (stored,) = _as_stored({"x": want})
    assert up_to_date(want, stored)
    stored["metadata"]["labels"] = {}
    assert not up_to_date(want, stored)
    (stored,) = _as_stored({"x": want})
    stored["metadata"]["ownerReferences"] = []
    assert not up_to_date(want, stored)


def test_an_empty_pool_still_publishes_one_slice() -> None:
    plan = plan_pool(DRIVER, PoolSpec(name="n1", node_name="n1", slice_specs=()), [], OWNER)
    assert len(plan.apply) == 1 and plan.apply[0]["spec"]["pool"]["resourceSliceCount"] == 1
