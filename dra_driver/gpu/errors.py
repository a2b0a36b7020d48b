"""The errors GPU discovery raises, each with a message a person can act on.

Callers catch `GpuDiscoveryError` (or one subclass) and never see a raw `pynvml.NVMLError`.
"""

from __future__ import annotations


class GpuDiscoveryError(Exception):
    """Discovery could not produce a complete inventory."""


class NvmlUnavailableError(GpuDiscoveryError):
    """NVML could not be initialized: no NVIDIA driver (or no libnvidia-ml) on this machine."""


class ProfileError(GpuDiscoveryError):
    """A simulated-hardware profile is missing, unreadable or malformed.

    `path` is the file, `field` the dotted location inside it (empty for the whole file).
    """

    def __init__(self, path: str, field: str, problem: str) -> None:
        self.path = path
        self.field = field
        self.problem = problem
        where = f"{path}: {field}" if field else path
        super().__init__(f"invalid GPU profile {where}: {problem}")
