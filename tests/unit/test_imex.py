"""IMEX channels and ComputeDomain readiness (pure), and the per-domain daemons with the
stand-in `nvidia-imex` (tests/harness/fake_imex.py) as real processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from controller.slices import SliceFeatures, desired_slices
from dra_driver.gpu import discover
from dra_driver.imex import domain as cd
from dra_driver.imex.channels import (
    ALL_CHANNELS,
    CHANNEL_DEVICE,
    ChannelConfigError,
    ChannelRequest,
    channel_nodes,
    channel_request,
    config_driver,
    node_clique,
)
from dra_driver.imex.daemons import ImexDaemons
from tests.harness.fake_imex import daemon_state, install_fake_imex, set_imex_mode
from tests.harness.objects import wait_for

DRIVER = "gpu.dra-driver.dev"
UID = "5b7c0f7e-8a4e-4c55-9f0e-2d1f4c3b2a10"


def _claim(*configs: dict[str, object]) -> dict[str, object]:
    return {"status": {"allocation": {"devices": {"results": [], "config": list(configs)}}}}


def _config(
    params: object, source: str = "FromClaim", driver: str = config_driver(DRIVER)
) -> dict[str, object]:
    return {"source": source, "requests": ["channel"], "opaque": {"driver": driver, "parameters": params}}


def _params(**extra: object) -> dict[str, object]:
    return {"apiVersion": f"{DRIVER}/v1beta1", "kind": "ComputeDomainChannelConfig", "domainID": UID, **extra}


def test_the_channel_config_is_read_as_nvidias_strictly() -> None:
    assert channel_request(_claim(_config(_params())), DRIVER) == ChannelRequest(UID, "Single")
    assert channel_request(_claim(_config(_params(allocationMode="All"))), DRIVER).allocation_mode == "All"
    nvidia = {**_params(), "apiVersion": "resource.nvidia.com/v1beta1"}
    assert channel_request(_claim(_config(nvidia)), DRIVER).domain_uid == UID
    # the claim's entry wins over the class's, whatever the order
    other = _params(domainID="other-uid")
    assert channel_request(_claim(_config(_params()), _config(other, "FromClass")), DRIVER).domain_uid == UID
    cases = {
        "carries no ComputeDomainChannelConfig": _claim(_config(_params(), driver=DRIVER)),
        "unknown field 'iommu'": _claim(_config(_params(iommu=True))),
        "domainID cannot be empty": _claim(_config(_params(domainID=""))),
        "is not a ComputeDomain UID": _claim(_config(_params(domainID="../etc"))),
        "must be Single or All": _claim(_config(_params(allocationMode="Some"))),
        "kind ComputeDomainChannelConfig": _claim(_config({**_params(), "kind": "GpuConfig"})),
        "must be an object": _claim(_config("x")),
    }
    for expected, claim in cases.items():
        with pytest.raises(ChannelConfigError, match=expected):
            channel_request(claim, DRIVER)


def test_single_gives_channel_0_and_all_gives_every_channel() -> None:
    (node,) = channel_nodes(ChannelRequest(UID, "Single"), 510)
    assert (node.path, node.major, node.minor, node.file_mode) == ("/dev/nvidia-caps-imex-channels/channel0",
                                                                   510, 0, 0o666)
    every = channel_nodes(ChannelRequest(UID, "All"), 510)
    assert len(every) == ALL_CHANNELS and every[-1].path.endswith(f"channel{ALL_CHANNELS - 1}")


def test_a_node_in_one_fabric_clique_publishes_its_channel_and_others_do_not() -> None:
    gb200 = discover("gb200-nvl-node")
    clique = node_clique(gb200)
    assert clique == "1f0708a8-1f80-4440-970d-338fe7fee8e1.32766"
    devices = [d for s in desired_slices(gb200, "n1", DRIVER, SliceFeatures(compute_domains=True))
               for d in s.get("devices", [])]
    channel = next(d for d in devices if d["name"] == CHANNEL_DEVICE)
    assert channel["attributes"] == {
        "type": {"string": "channel"}, "id": {"int": 0}, "cliqueID": {"string": clique}}
    off = [d for s in desired_slices(gb200, "n1", DRIVER, SliceFeatures()) for d in s.get("devices", [])]
    assert CHANNEL_DEVICE not in {d["name"] for d in off}
    h200 = discover("hgx-h200")
    assert node_clique(h200) is None
    on = [d for s in desired_slices(h200, "n1", DRIVER, SliceFeatures(compute_domains=True))
          for d in s.get("devices", [])]
    assert CHANNEL_DEVICE not in {d["name"] for d in on}


def _domain(num: int, *nodes: dict[str, object]) -> dict[str, object]:
    return {"metadata": {"uid": UID, "name": "d", "namespace": "ns"}, "spec": {"numNodes": num},
            "status": {"nodes": list(nodes)}}


def _node(name: str, status: str = "Ready", clique: str = "c.1", index: int = 0) -> dict[str, object]:
    return {"name": name, "ipAddress": f"10.0.0.{index + 1}", "cliqueID": clique, "index": index,
            "status": status}


def test_a_domain_is_ready_once_numnodes_nodes_joined_and_each_is_ready() -> None:
    assert cd.waiting_for(_domain(2, _node("a"))) == "1 of spec.numNodes 2 nodes have joined"
    assert "not ready on b" in str(cd.waiting_for(_domain(2, _node("a"), _node("b", "NotReady", index=1))))
    assert cd.waiting_for(_domain(2, _node("a"), _node("b", index=1))) is None
    assert cd.waiting_for(_domain(0)) is None  # NVIDIA's rule: no nodes asked for, none needed


def test_a_node_gets_the_lowest_free_index_of_its_clique_and_keeps_it() -> None:
    domain = _domain(3, _node("a", index=0), _node("c", index=2), _node("x", clique="c.2", index=1))
    assert cd.own_entry(domain, "b", "10.0.0.9", "c.1", False).index == 1
    assert cd.own_entry(domain, "c", "10.0.0.3", "c.1", True).index == 2
    assert cd.peer_addresses(domain, "c.1") == ["10.0.0.1", "10.0.0.3"]


def test_a_domain_never_spans_two_cliques() -> None:
    domain = _domain(2, _node("a", clique="c.1"))
    refusal = cd.clique_refusal(domain, "b", "c.2")
    assert refusal is not None and "c.2" in refusal and "c.1" in refusal and "node b" in refusal
    assert cd.clique_refusal(domain, "b", "c.1") is None
    assert cd.clique_refusal(domain, "a", "c.2") is None  # its own entry is no other clique


@pytest.fixture
def daemons(tmp_path: Path) -> ImexDaemons:
    install_fake_imex(tmp_path / "driver")
    return ImexDaemons(tmp_path / "imex", tmp_path / "driver", stop_timeout=5)


def test_a_domains_daemon_starts_once_follows_its_peers_and_stops_with_its_last_claim(
    daemons: ImexDaemons, tmp_path: Path
) -> None:
    request = ChannelRequest(UID, "Single")
    set_imex_mode(tmp_path / "driver" / "usr" / "bin", ready_after=0.5)
    daemons.ensure(UID, "ns", "d", "claim-1", request, ["10.0.0.1"], "10.0.0.1")
    pid = daemons.pid(UID)
    assert pid is not None
    assert not daemons.ready(UID)  # not yet: the stand-in takes 0.5 s
    wait_for("the daemon ready", lambda: daemons.ready(UID), timeout=10)
    daemons.ensure(UID, "ns", "d", "claim-2", request, ["10.0.0.1", "10.0.0.2"], "10.0.0.1")
    assert daemons.pid(UID) == pid  # one daemon per domain
    wait_for("the new peer read", lambda: (daemon_state(daemons.root, UID) or {}).get("reloads") == 1)
    assert (daemon_state(daemons.root, UID) or {})["peers"] == ["10.0.0.1", "10.0.0.2"]
    assert daemons.request_of("claim-2") == request
    assert daemons.release("claim-1") == [] and daemons.pid(UID) == pid
    assert daemons.release("claim-2") == [UID]
    assert daemons.pid(UID) is None and not (daemons.root / UID).exists()
    assert daemons.left() == [(UID, "ns", "d")] and daemons.left() == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_restart_adopts_a_running_daemon_and_starts_a_dead_one_again(
    daemons: ImexDaemons, tmp_path: Path
) -> None:
    daemons.ensure(UID, "ns", "d", "claim-1", ChannelRequest(UID, "All"), [], "10.0.0.1")
    pid = daemons.pid(UID)
    assert pid is not None
    later = ImexDaemons(daemons.root, tmp_path / "driver")  # the next plugin process
    assert later.pid(UID) == pid and later.sweep(frozenset({"claim-1"})) == [] and later.pid(UID) == pid
    os.kill(pid, signal.SIGKILL)
    wait_for("the killed daemon gone", lambda: daemons.pid(UID) is None)
    assert later.sweep(frozenset({"claim-1"})) == []
    assert later.pid(UID) not in (None, pid)
    # a claim with no checkpoint entry whose Prepare last asked long ago is dropped, and its daemon stops
    assert later.sweep(frozenset(), now=time.time() + 3600) == [UID]
    assert later.pid(UID) is None and later.domains() == []


def test_a_daemon_that_cannot_start_is_said_and_leaves_no_process(
    daemons: ImexDaemons, tmp_path: Path
) -> None:
    set_imex_mode(tmp_path / "driver" / "usr" / "bin", fail=True)
    daemons.ensure(UID, "ns", "d", "claim-1", ChannelRequest(UID, "Single"), [], "10.0.0.1")
    wait_for("the failed daemon gone", lambda: daemons.pid(UID) is None)
    assert not daemons.ready(UID)
    assert "cannot start" in (daemons.root / UID / "start.log").read_text()


def test_the_controller_drops_entries_of_nodes_without_a_claim_and_marks_down_nodes_not_ready() -> None:
    from controller import compute_domains as plan

    label = plan.domain_label(DRIVER)

    def claim(uid: str, node: str, device: str = CHANNEL_DEVICE) -> dict[str, object]:
        return {"metadata": {"labels": {label: uid}},
                "status": {"allocation": {"devices": {"results": [
                    {"driver": DRIVER, "pool": node, "device": device, "request": "channel"}]}}}}

    claims = [claim(UID, "a"), claim(UID, "b"), claim("other", "c"), claim(UID, "d", "gpu-0")]
    holding = plan.claim_nodes(claims, DRIVER)
    assert holding == {UID: frozenset({"a", "b"}), "other": frozenset({"c"})}
    nodes = [{"metadata": {"name": n}, "status": {"conditions": [{"type": "Ready", "status": s}]}}
             for n, s in (("a", "True"), ("b", "Unknown"), ("c", "False"))] + [{"metadata": {"name": "x"}}]
    assert plan.down_nodes(nodes) == frozenset({"b", "c"})
    domain = _domain(3, _node("a"), _node("b", index=1), _node("gone", index=2))
    wanted = plan.membership(domain, holding[UID], plan.down_nodes(nodes))
    assert wanted == plan.Membership(stale=("gone",), down=("b",))
    # an entry already NotReady is not written again
    assert plan.membership(_domain(1, _node("b", "NotReady")), frozenset({"b"}), frozenset({"b"})).down == ()
