"""The errors of the MPS machinery (`dra_driver.sharing.mps`); data only, no I/O."""

from __future__ import annotations

from collections.abc import Set
from pathlib import Path


class MpsError(Exception):
    """An MPS daemon could not be started or stopped; the message says what happened."""


class MpsRootRefused(MpsError):
    """The plugin must not start on this MPS root; the message says what to change."""


class MpsRootOfAnotherDriver(MpsRootRefused):
    """The MPS root is another driver's (two releases given one mpsRoot): a plugin must
    neither adopt nor stop daemons it did not start, nor delete their directories."""

    def __init__(self, root: Path, owner: str, driver: str) -> None:
        super().__init__(
            f"MPS root {root} belongs to driver {owner}, and this plugin is driver {driver}: two "
            "drivers must not share an MPS root (this plugin would stop the other's MPS daemons and "
            "remove their pipe directories under its running pods). Give each release its own "
            "(--mps-root; the chart's mpsRoot; both default to /run/<driver name>/mps) and restart "
            f"this plugin; nothing under {root} was changed"
        )
        self.root = root
        self.owner = owner
        self.driver = driver


class MpsRootInUse(MpsRootRefused):
    """The MPS root has no owner file and daemons of claims this driver has not prepared live
    in it: another driver's plugin (of a release that wrote no owner file) uses it, and
    taking the root over would stop those daemons under that driver's running pods."""

    def __init__(self, root: Path, driver: str, claims: Set[str], api_unanswered: bool = False) -> None:
        shown = ", ".join(sorted(claims)[:3]) + (f" and {len(claims) - 3} more" if len(claims) > 3 else "")
        unsure = (
            f" (the API server could not say which claims are allocated to this node for driver {driver}: "
            "if they are this driver's own, restart this plugin once the API server answers)"
            if api_unanswered else ""
        )
        super().__init__(
            f"MPS root {root} has no owner file, and MPS daemons live in it for claims {shown}, which "
            f"driver {driver} has not prepared on this node{unsure}: another driver's plugin (of a release "
            "that wrote no owner file) uses this MPS root, and this plugin would stop its daemons under its "
            "running pods. Give each release its own MPS root (--mps-root; the chart's mpsRoot; both "
            f"default to /run/<driver name>/mps) and restart this plugin; nothing under {root} was changed"
        )
        self.root = root
        self.driver = driver
        self.claims = frozenset(claims)
