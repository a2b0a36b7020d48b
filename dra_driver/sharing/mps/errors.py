"""The errors of the MPS machinery (`dra_driver.sharing.mps`); data only, no I/O."""

from __future__ import annotations

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
