"""Which NVML the node daemon's parts talk to: the host's (pynvml) or, with `--simulate`,
the simulated GPUs' (FakeNvml over the same profile). The health monitor's choice, which
also needs an event source, is `dra_driver.health.node.nvml_for`.

pynvml and the simulation are imported only when asked for. Must not call NVML itself.
"""

from __future__ import annotations

from typing import cast

from dra_driver.gpu import load_profile
from dra_driver.gpu.compute_mode import ComputeModes
from dra_driver.gpu.mig import MigApi
from dra_driver.node.options import NodeOptions


def compute_modes(opts: NodeOptions) -> ComputeModes:
    """NVML for compute modes: the host's, or the simulated GPUs' own (FakeNvml keeps them)."""
    if opts.simulate is None:
        import pynvml

        return ComputeModes(pynvml)
    from dra_driver.gpu.simulated import FakeNvml

    return ComputeModes(FakeNvml(load_profile(opts.simulate)))


def mig_api(opts: NodeOptions) -> MigApi:
    """NVML for creating MIG instances: the host's, or the simulated GPUs' (FakeNvml)."""
    if opts.simulate is None:
        import pynvml

        return cast(MigApi, pynvml)
    from dra_driver.gpu.simulated import FakeNvml

    return FakeNvml(load_profile(opts.simulate), mig_state_file=opts.simulated_mig_state)
