"""The host's network links as the node harness sees them: which exist, which are ports of a
bridge, and which of the harness's own a teardown left behind.

A pod's veth pair goes with its network namespace, and the namespace can outlive the node's
sandbox: an orphaned TCP socket of a killed pod (a plugin's API connection whose peer, the
Service address, is already gone) retransmits its FIN for about 100 s and pins the namespace,
so the host end of the veth stays that long after the harness has finished. The harness
therefore deletes its bridges' ports by name (`bridge_ports`) and checks, after its teardown,
that none of the links it made or saw on its bridges is left (`links_left_behind`).

Parsing is pure; `link_names` and `bridge_ports` run `ip`. This module deletes nothing and
never names a link that was there before the harness started or that it did not make.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable

# `ip -o link` rows: "6038: veth532290ab@if2: <BROADCAST,...> ..."; the name ends at '@' or ':'.
_ROW = re.compile(r"^\d+:\s+([^:@\s]+)")


class LinksLeftBehind(RuntimeError):
    """The node harness's teardown left links of its own on the host."""


def parse_link_names(ip_o_link: str) -> list[str]:
    """Link names from the output of `ip -o link show ...`, in its order."""
    return [m.group(1) for line in ip_o_link.splitlines() if (m := _ROW.match(line))]


def _ip_o_link(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "-o", "link", "show", *args], capture_output=True, text=True, check=False)


def link_names() -> set[str]:
    """Every link of this network namespace now."""
    shown = _ip_o_link()
    if shown.returncode != 0:
        raise RuntimeError(f"ip -o link show: {shown.stderr.strip()}")
    return set(parse_link_names(shown.stdout))


def bridge_ports(bridge: str) -> list[str]:
    """The links enslaved to `bridge` (its pods' veth host ends); none once the bridge is gone."""
    shown = _ip_o_link("master", bridge)
    return parse_link_names(shown.stdout) if shown.returncode == 0 else []


def links_left_behind(before: Iterable[str], now: Iterable[str], ours: Iterable[str]) -> list[str]:
    """The links of `ours` (made by the harness or seen on its bridges) that exist `now` and
    did not `before` the harness started: links of other users of this host never count."""
    return sorted((set(now) - set(before)) & set(ours))
