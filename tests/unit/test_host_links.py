"""The node harness's link accounting (tests.harness.host_links): the names read from `ip -o link`,
and which links a teardown counts as left behind (its own only, never another user's)."""

from __future__ import annotations

from tests.harness.host_links import bridge_ports, links_left_behind, parse_link_names

# `ip -o link` as seen after tests/node/test_plain_manifests.py before the reaper deleted pod veths
# (addresses shortened): a node link pair, its bridge, a pod veth whose peer is in a pod namespace.
IP_O_LINK = """\
1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN\\    link/loopback 00:00:00:00:00:00
4: eth0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc mq state UP\\    link/ether 02:42:ac:11:00:02
6030: dn3bfbe1p@dn3bfbe1: <BROADCAST,MULTICAST,UP> mtu 1500 state UP\\    link/ether 1e:aa:00:00:00:01
6031: dn3bfbe1@dn3bfbe1p: <BROADCAST,MULTICAST,UP> mtu 1500 state UP\\    link/ether 1e:aa:00:00:00:02
6032: db3bfbe1: <BROADCAST,MULTICAST,UP> mtu 1500 state UP\\    link/ether 1e:aa:00:00:00:03
6038: veth532290ab@if2: <BROADCAST,MULTICAST,UP> mtu 1500 master db3bfbe1\\    link/ether da:5d:95:8a:d4:f9
"""


def test_names_end_at_the_peer_or_the_colon() -> None:
    assert parse_link_names(IP_O_LINK) == ["lo", "eth0", "dn3bfbe1p", "dn3bfbe1", "db3bfbe1", "veth532290ab"]
    assert parse_link_names("") == []


def test_only_the_harness_links_made_after_it_started_are_left_behind() -> None:
    before = {"lo", "eth0", "veth0ther111"}  # veth0ther111: another user's, there before the start
    ours = {"dn3bfbe1", "dn3bfbe1p", "db3bfbe1", "veth532290ab", "veth0ther111"}
    now = {"lo", "eth0", "veth0ther111", "veth532290ab", "vethf0reign2"}  # vethf0reign2: not ours
    assert links_left_behind(before, now, ours) == ["veth532290ab"]
    assert links_left_behind(before, before, ours) == []


def test_a_bridge_that_is_gone_has_no_ports() -> None:
    assert bridge_ports("dbnosuch0") == []
