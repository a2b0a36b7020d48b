"""A GPU's compute mode through NVML: read it, set it, by UUID.

Whole-GPU MPS claims run their GPUs in exclusive-process mode (one context, the MPS
server's, so a process of the pod cannot step around MPS and take the GPU directly);
`dra_driver.sharing.mps.compute_modes` decides when, and records the mode it found so that it can put
it back. This module only talks to NVML: `pynvml` on a GPU node, `FakeNvml` (which models
compute mode as NVML does) in simulations and tests. Each call is one short
`nvmlInit`/`nvmlShutdown` pair (NVML counts them), so it can run in the prepare path,
unlike discovery. It must not decide anything.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

import pynvml

DEFAULT: Final = int(pynvml.NVML_COMPUTEMODE_DEFAULT)
PROHIBITED: Final = int(pynvml.NVML_COMPUTEMODE_PROHIBITED)
EXCLUSIVE_PROCESS: Final = int(pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
NAMES: Final = {DEFAULT: "Default", PROHIBITED: "Prohibited", EXCLUSIVE_PROCESS: "ExclusiveProcess"}


class ComputeModeError(Exception):
    """NVML could not read or set a GPU's compute mode; the message says which and why."""


class ComputeModeApi(Protocol):
    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any: ...
    def nvmlDeviceGetComputeMode(self, handle: Any) -> int: ...
    def nvmlDeviceSetComputeMode(self, handle: Any, mode: int) -> None: ...


def name(mode: int) -> str:
    return NAMES.get(mode, str(mode))


class ComputeModes:
    """Compute modes of this node's GPUs (`api`: the pynvml module or a FakeNvml)."""

    def __init__(self, api: ComputeModeApi) -> None:
        self.api = api

    def get(self, uuid: str) -> int:
        try:
            self.api.nvmlInit()
            try:
                return int(self.api.nvmlDeviceGetComputeMode(self.api.nvmlDeviceGetHandleByUUID(uuid)))
            finally:
                self.api.nvmlShutdown()
        except pynvml.NVMLError as e:
            raise ComputeModeError(f"reading the compute mode of GPU {uuid} failed: {e}") from e

    def set(self, uuid: str, mode: int) -> None:
        try:
            self.api.nvmlInit()
            try:
                self.api.nvmlDeviceSetComputeMode(self.api.nvmlDeviceGetHandleByUUID(uuid), mode)
            finally:
                self.api.nvmlShutdown()
        except pynvml.NVMLError as e:
            raise ComputeModeError(f"setting GPU {uuid} to compute mode {name(mode)} failed: {e}") from e
