"""What health does to the outside: taints in the slices (written once per change), the
kubelet health stream (Unhealthy with a message, resent before the kubelet's 30 s), the
history file `dra-driver inventory` shows."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from pathlib import Path

import pytest
from click.testing import CliRunner

from controller.plan import PoolSpec
from controller.reconciler import SliceController
from controller.slices import SliceFeatures, desired_slices
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver import log
from dra_driver.commands.inventory import inventory as inventory_command
from dra_driver.devices import node_devices
from dra_driver.gpu import discover
from dra_driver.health import history
from dra_driver.health.classify import HealthPolicy
from dra_driver.health.effects import DeviceTaint, label_value
from dra_driver.health.events import EventKind, HealthEvent, Probe
from dra_driver.health.keeper import HealthKeeper
from dra_driver.plugin.health import DeviceHealth, DeviceHealthBoard, keep_fresh, mirror
from dra_driver.sharing.shares import share_views
from tests.harness.objects import wait_for_async

NODE = "node-a"
XID79 = HealthEvent(gpu=2, kind=EventKind.XID, data=79, recovery_action=1, at=1.0)


def test_taints_go_on_the_device_and_its_share_view_with_time_added() -> None:
    inv = discover("hgx-h200")
    taint = DeviceTaint(f"{DRIVER}/xid", "79", "NoSchedule", 1_796_000_000)
    plain = desired_slices(inv, NODE, DRIVER, SliceFeatures(memory_shares=True))
    tainted = desired_slices(inv, NODE, DRIVER, SliceFeatures(memory_shares=True),
                             {"gpu-2": (taint,), "gpu-2-share": (taint,)})
    devices = {d["name"]: d for spec in tainted for d in spec.get("devices", [])}
    expected = [
        {"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule", "timeAdded": "2026-11-30T00:53:20Z"}
    ]
    assert devices["gpu-2"]["taints"] == expected
    assert devices["gpu-2-share"]["taints"] == expected
    assert [n for n, d in devices.items() if "taints" in d] == ["gpu-2", "gpu-2-share"]
    untouched = {d["name"]: d for spec in plain for d in spec.get("devices", [])}
    assert {n: d for n, d in devices.items() if n not in ("gpu-2", "gpu-2-share")} == {
        n: d for n, d in untouched.items() if n not in ("gpu-2", "gpu-2-share")
    }
    no_taints = desired_slices(inv, NODE, DRIVER, SliceFeatures(), {})
    assert no_taints == desired_slices(inv, NODE, DRIVER, SliceFeatures())


def test_where_the_server_drops_taints_a_sick_gpu_is_left_out_until_it_recovers() -> None:
    """1.34/1.35 with default gates keep no device taints (issue 54): a GPU the health monitor
    taints is then not offered at all, neither whole nor as a share or a MIG placement, so the
    scheduler gives it to no new pod; with no taint it is offered again."""
    taint = DeviceTaint(f"{DRIVER}/xid", "79", "NoSchedule", 1_796_000_000)
    features = SliceFeatures(memory_shares=True, dynamic_mig=True, taints=False)
    for profile, sick in (("hgx-h200", "gpu-2"), ("hgx-h200-mig", "gpu-0")):
        inv = discover(profile)
        healthy = {d["name"] for s in desired_slices(inv, NODE, DRIVER, features)
                   for d in s.get("devices", [])}
        during = [d for s in desired_slices(inv, NODE, DRIVER, features, {sick: (taint,)})
                  for d in s.get("devices", [])]
        assert not [d for d in during if "taints" in d], "no taint where the server drops them"
        gone = healthy - {d["name"] for d in during}
        assert sick in gone or any(n.startswith(f"{sick}-") for n in gone), (profile, gone)
        assert all(n == sick or n.startswith(f"{sick}-") for n in gone), (profile, gone)
        assert desired_slices(inv, NODE, DRIVER, features, {}) == desired_slices(inv, NODE, DRIVER, features)


def test_a_tainted_pool_keeps_within_the_64_device_limit() -> None:
    inv = discover("a100-mig")
    names = list(node_devices(inv))
    taint = DeviceTaint(f"{DRIVER}/ecc", "double-bit-ecc", "NoExecute", 0)
    specs = desired_slices(inv, NODE, DRIVER, SliceFeatures(), {names[0]: (taint,)})
    assert all(len(s.get("devices", [])) <= 64 for s in specs)


def test_set_taints_marks_the_pool_only_when_its_slices_change() -> None:
    inv = discover("h200-single")
    features = SliceFeatures()
    ctl = SliceController(api=None, driver=DRIVER,  # type: ignore[arg-type]  # no API call is made here
                          pools={NODE: PoolSpec(NODE, NODE, desired_slices(inv, NODE, DRIVER, features))},
                          inventories={NODE: inv}, features=features)
    taint = DeviceTaint(f"{DRIVER}/xid", "79", "NoSchedule", 100)
    assert not ctl.set_taints(NODE, {})
    assert ctl.set_taints(NODE, {"gpu-0": (taint,)})
    assert not ctl.set_taints(NODE, {"gpu-0": (taint,)}), "same taints again: nothing to write"
    assert ctl.set_taints(NODE, {})
    assert ctl.pools[NODE].slice_specs == desired_slices(inv, NODE, DRIVER, features)


def test_label_values() -> None:
    assert label_value("79") == "79"
    assert label_value("drain and reset!") == "drain-and-reset"
    assert len(label_value("x" * 100)) == 63


def _keeper() -> HealthKeeper:
    inv = discover("hgx-h200")
    devices = node_devices(inv)
    devices.update(share_views(devices))
    return HealthKeeper(DRIVER, devices, HealthPolicy(quiet_period=0.0), clock=lambda: 1_796_000_000.0)


def test_the_health_stream_follows_the_keeper_and_is_resent_while_the_monitor_lives() -> None:
    async def scenario() -> None:
        keeper = _keeper()
        board = DeviceHealthBoard(NODE, keeper.devices)
        sent: asyncio.Queue[tuple[DeviceHealth, ...]] = asyncio.Queue()

        async def stream() -> None:  # what the kubelet's NodeWatchResources stream gets
            async for snapshot in board.follow():
                sent.put_nowait(snapshot)

        def next_list(timeout: float = 10.0) -> Awaitable[tuple[DeviceHealth, ...]]:
            return asyncio.wait_for(sent.get(), timeout)

        tasks = [asyncio.create_task(stream()), asyncio.create_task(mirror(board, keeper))]
        first = await next_list()
        assert {h.status for h in first} == {"HEALTHY"}
        keeper.apply([XID79])
        changed = await next_list()
        unhealthy = {h.device: h.message for h in changed if h.status == "UNHEALTHY"}
        assert sorted(unhealthy) == ["gpu-2", "gpu-2-share"]
        assert "XID 79" in unhealthy["gpu-2"]
        # the kubelet marks a device Unknown 30 s after its last report: the list comes again
        alive, asked = [True], [0]

        def vouching() -> bool:  # the NVML loop's liveness, as keep_fresh asks for it
            asked[0] += 1
            return alive[0]

        tasks.append(asyncio.create_task(keep_fresh(board, vouching, every=0.05)))
        again = await next_list()
        assert [h.updated for h in again] != [h.updated for h in changed]
        assert {h.device for h in again if h.status == "UNHEALTHY"} == set(unhealthy)
        alive[0] = False  # a wedged NVML loop: stop vouching, let the kubelet decay to Unknown
        seen = asked[0]
        # asked twice since, keep_fresh has no refresh in flight: what it sent is in `sent`
        await wait_for_async("keep_fresh to find no one vouching", lambda: asked[0] >= seen + 2,
                             detail=lambda: asked[0] - seen)
        while not sent.empty():
            sent.get_nowait()
        with pytest.raises(TimeoutError):
            await next_list(0.3)
        keeper.apply([Probe(2, lost=False, recovery_action=0)])
        keeper.settle()
        healed = await next_list()
        assert {h.status for h in healed} == {"HEALTHY"} and {h.message for h in healed} == {""}
        for task in tasks:
            task.cancel()

    asyncio.run(scenario())


def test_the_history_file_is_rewritten_after_a_change_not_after_each_check() -> None:
    keeper = _keeper()
    well = [Probe(gpu, lost=False, recovery_action=None, at=1.0) for gpu in range(8)]
    keeper.apply(well)
    assert keeper.history_version == 0, "checks of well GPUs change nothing to write"
    keeper.apply([XID79])
    assert keeper.history_version == 1
    keeper.apply([Probe(2, lost=False, recovery_action=None, at=2.0)])  # gpu-2 checks out: clearing starts
    assert keeper.history_version == 2
    keeper.apply([Probe(2, lost=True, recovery_action=None, at=3.0)])
    assert keeper.history_version == 3 and not keeper.views["gpu-2"].healthy


def test_the_history_file_is_what_inventory_shows(tmp_path: Path) -> None:
    keeper = _keeper()
    keeper.apply([XID79, HealthEvent(gpu=2, kind=EventKind.XID, data=13, count=250, at=2.0)])
    path = tmp_path / "health.json"
    history.write(keeper, path, 1_796_000_000.0)
    doc = history.read(path)
    assert doc is not None
    gpu2 = doc["devices"]["gpu-2"]
    assert not gpu2["healthy"] and gpu2["counts"] == {"xid-13": 250, "xid-79": 1}
    assert gpu2["taints"] == [{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule",
                               "timeAdded": "2026-11-30T00:53:20Z"}]
    assert doc["devices"]["gpu-0"]["healthy"] and doc["eventsSeen"] == 251
    text = history.render(doc)
    assert "gpu-2" in text and "xid-13=250" in text and f"taint {DRIVER}/xid=79:NoSchedule" in text

    log.configure("warning", "json")  # as `dra-driver` does: logs to stderr, stdout is the document
    runner = CliRunner()
    sim = ["--simulate", "hgx-h200"]
    shown = runner.invoke(inventory_command, [*sim, "--health-file", str(path)])
    assert shown.exit_code == 0, shown.output
    assert "Unhealthy: XID 79" in shown.output
    as_json = runner.invoke(inventory_command, [*sim, "-o", "json", "--health-file", str(path)])
    assert json.loads(as_json.stdout)["health"]["devices"]["gpu-2"]["counts"]["xid-79"] == 1
    missing = runner.invoke(inventory_command, [*sim, "--health-file", str(tmp_path / "no")])
    assert missing.exit_code == 0 and "Device health" not in missing.output
    path.write_text("{broken")
    broken = runner.invoke(inventory_command, [*sim, "--health-file", str(path)])
    assert broken.exit_code != 0 and "not a health history document" in broken.output
