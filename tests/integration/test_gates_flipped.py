"""DRA feature gates turned off and on under a running plugin (issue 54 item 3): the plugin
follows without a restart, and says each change once.

A control plane of its own (its kube-apiserver is restarted with other gates, so no other
test shares it) and one `dra-driver kubelet-plugin` on a simulated HGX H200 asking the server
again every second (`--server-probe-interval 1`). `DRAListTypeAttributes` off: the list-type
attributes (nvlinkCliques) leave the slices instead of the slices being stripped by the server;
`DRADeviceTaints` off: health taints are turned off with one Warning Event; both on again: all
of it back, with one Event. A restarted plugin posts no second Event for a change it already
reported.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.harness.cluster import ControlPlane
from tests.harness.objects import sync_client, sync_request, wait_for
from tests.harness.plugin_node import node_slices, plugin_node

NODE = f"gates-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def control_plane() -> Iterator[ControlPlane]:
    cp = ControlPlane.start(work_dir=Path(tempfile.mkdtemp(prefix="gates-")))
    try:
        _gates(cp, DRAListTypeAttributes=True, **_taints(True))
        yield cp
    finally:
        cp.stop()


def _taints(on: bool) -> dict[str, bool]:
    """DRADeviceTaints and DRADeviceTaintRules, which needs it (both GA on 1.37, still settable)."""
    return {"DRADeviceTaints": on, "DRADeviceTaintRules": on}


def _gates(cp: ControlPlane, **gates: bool) -> None:
    """Restart kube-apiserver with `gates` set (the others as the harness runs them)."""
    argv = cp.argv["kube-apiserver"]
    current = next((a.split("=", 1)[1] for a in argv if a.startswith("--feature-gates=")), "")
    merged = dict(g.split("=") for g in current.split(",") if g)
    merged.update({k: str(v).lower() for k, v in gates.items()})
    cp.argv["kube-apiserver"] = [a for a in argv if not a.startswith("--feature-gates=")] + [
        "--feature-gates=" + ",".join(f"{k}={v}" for k, v in merged.items())]
    cp.stop_component("kube-apiserver")
    cp.start_component("kube-apiserver")


def _list_attributes(api: client.ApiClient) -> list[str]:
    """Names of the list-valued attributes in the node's slices."""
    return sorted({name for s in node_slices(api, NODE) for d in s["spec"].get("devices", [])  # type: ignore[index]
                   for name, value in d.get("attributes", {}).items()
                   if set(value) & {"ints", "strings", "bools", "versions"}})


def _events(api: client.ApiClient, reason: str) -> list[str]:
    query = {"fieldSelector": f"involvedObject.kind=Node,involvedObject.name={NODE},reason={reason}"}
    items: list[dict[str, Any]] = sync_request(api, "GET", "/api/v1/namespaces/default/events",
                                               query=query)["items"]
    return [str(e["message"]) for e in items]


def test_gates_turned_off_and_on_are_followed_without_a_restart(control_plane: ControlPlane) -> None:
    api = sync_client(str(control_plane.kubeconfig))
    root = Path(tempfile.mkdtemp(prefix="gt-", dir="/tmp"))
    args = ("--server-probe-interval", "1")
    with plugin_node(api, control_plane.kubeconfig, NODE, "hgx-h200", root / "a", args,
                     published=lambda: _list_attributes(api), what="list-type attributes published") as n:
        pid = n.plugin.pid
        _gates(control_plane, DRAListTypeAttributes=False, **_taints(False))
        wait_for("the list-type attributes to leave the slices", lambda: not _list_attributes(api),
                 timeout=60)
        changed = wait_for("a DRAFeaturesChanged Event naming both",
                           lambda: [m for m in _events(api, "DRAFeaturesChanged")
                                    if "device health taints is off" in m and "no longer published" in m],
                           timeout=30)
        assert len(changed) == 1, changed
        assert "DRADeviceTaints" in changed[0], changed[0]

        _gates(control_plane, DRAListTypeAttributes=True, **_taints(True))
        wait_for("the list-type attributes back", lambda: _list_attributes(api), timeout=60)
        back = wait_for("the Event saying so",
                        lambda: [m for m in _events(api, "DRAFeaturesChanged") if "is on again" in m],
                        timeout=30)
        assert "device health taints is on again" in back[0], back
        assert n.plugin.pid == pid and n.plugin.proc is not None and n.plugin.proc.poll() is None

    # Started with a gate off, twice: one DRAFeatureOff Event, not one per start.
    _gates(control_plane, **_taints(False))
    for attempt in ("b", "c"):
        with plugin_node(api, control_plane.kubeconfig, NODE, "hgx-h200", root / attempt, args):
            wait_for("the DRAFeatureOff Event", lambda: _events(api, "DRAFeatureOff"), timeout=30)
    off = [m for m in _events(api, "DRAFeatureOff") if m.startswith("device health taints")]
    assert len(off) == 1, off
