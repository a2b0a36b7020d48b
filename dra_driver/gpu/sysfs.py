"""What the kernel says about a GPU's PCI device (sysfs): its PCIe root complex and its NUMA
node, facts NVML does not give or gives wrongly in a VM. `HostSysfs` reads this machine's
/sys; a simulated profile answers the same `PciSysfs` questions (`FakeSysfs`).

Read once, at discovery (`dra_driver.gpu.nvml.discover`); it must not be called from the
prepare path, nor write to sysfs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Protocol


class PciSysfs(Protocol):
    """What the kernel says about a PCI device (sysfs); the host or a profile answers."""

    def pcie_root(self, bus_id: str) -> str | None: ...
    def numa_node(self, bus_id: str) -> int | None: ...


# A host bridge as sysfs names it (and a profile spells it)
PCIE_ROOT = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")


def pcie_root_from_path(path: PurePath) -> str | None:
    """The `pciDDDD:BB` host-bridge component of a resolved sysfs device path, if any."""
    for part in path.parts:
        if PCIE_ROOT.match(part):
            return part
    return None


@dataclass(frozen=True)
class HostSysfs:
    """Reads `/sys/bus/pci/devices/<bus id>` on this machine (`root` is replaceable for tests)."""

    root: Path = Path("/sys")

    def _device(self, bus_id: str) -> Path:
        return self.root / "bus" / "pci" / "devices" / bus_id

    def pcie_root(self, bus_id: str) -> str | None:
        try:
            resolved = self._device(bus_id).resolve(strict=True)
        except OSError:
            return None
        return pcie_root_from_path(resolved)

    def numa_node(self, bus_id: str) -> int | None:
        try:
            text = (self._device(bus_id) / "numa_node").read_text().strip()
            node = int(text)
        except (OSError, ValueError):
            return None
        return node if node >= 0 else None
