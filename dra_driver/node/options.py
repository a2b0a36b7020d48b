"""What `dra-driver kubelet-plugin` was asked to do, one field per command-line option.

The field names are the click parameters' own names, so the command fills this object
directly; what follows from several options (defaults that depend on the driver name, a
flag implied by another) is a property here, not a copy. It must not read files or
environment variables: click has done that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from dra_driver.health.classify import HealthPolicy, Severity, TaintEffect
from dra_driver.plugin.claim_source import DEFAULT_TIMEOUT_SECONDS
from dra_driver.sharing.consumable import ConsumableShares

SIMULATED_MIG_STATE: Final = "simulated-mig.json"
# How often the API server is asked again what it keeps (controller.publisher.follow_server):
# a DRA gate flipped under a running plugin is followed within about this long, for four
# dry-run creates per node; the fleet controller uses it too.
SERVER_PROBE_SECONDS: Final = 300.0


@dataclass(frozen=True)
class NodeOptions:
    node_name: str
    driver_name: str
    kubelet_dir: Path
    cdi_dir: Path
    simulate: str | None = None
    kubeconfig: str | None = None
    list_attributes: Literal["auto", "on", "off"] = "auto"
    driver_root: Path | None = None  # None: / on a GPU node, no driver files for simulated GPUs
    host_driver_root: Path | None = None
    dev_root: Path = Path("/dev")
    mps_root: Path | None = None  # None: /run/<driver-name>/mps
    mps_host_cgroup: bool = False
    mps_exclusive_compute_mode: bool = False
    compute_domains: bool = False  # IMEX channels and daemons (docs/compute-domains.md)
    imex_root: Path | None = None  # None: /run/<driver-name>/imex
    node_ip: str | None = None  # None: the Node's InternalIP
    compute_domain_wait: float = 10.0  # seconds a channel Prepare waits inside the call
    state_dir: Path | None = None  # None: /run/<driver-name>/state (`state`)
    rolling_update_uid: str | None = None
    claim_read_timeout: float = DEFAULT_TIMEOUT_SECONDS
    publish_slices: bool = True
    server_probe_interval: float = SERVER_PROBE_SECONDS  # 0: the server's features are read at start only
    extended_resource: str | None = None  # the chart's extendedResource.name: its class is checked
    metrics_port: int = 0  # 0: no metrics or probe port
    metrics_bind_address: str = "0.0.0.0"
    claim_identity_metric: bool = False
    memory_shares: bool = False
    memory_shares_only: bool = False  # each whole GPU as its share view alone (controller.capacity)
    consumable_shares: ConsumableShares | None = None  # NVIDIA's consumable shares (sharing.consumable)
    dynamic_mig: bool = False  # MIG-mode GPUs carved by claims (docs/mig.md)
    legacy_attributes: bool = False  # also nvlinkGroup<N>, numaNode (controller.attributes.LEGACY_ATTRIBUTES)
    # also nvlinkPeers, nvlinkPeerCount, nvlinkIsland (controller.attributes.TOPOLOGY_DETAIL_ATTRIBUTES)
    topology_detail_attributes: bool = False
    health_monitor: bool = True
    health_taint_effect: TaintEffect = "NoSchedule"
    health_quiet_period: float = 60.0
    health_xid_severity: dict[int, Severity] = field(default_factory=dict)
    simulate_health_events: Path | None = None

    @property
    def state(self) -> Path:
        """Where the checkpoint and its lock live."""
        return self.state_dir or Path("/run") / self.driver_name / "state"

    @property
    def shares(self) -> bool:
        """Share views published (--memory-shares-only implies --memory-shares)."""
        return self.memory_shares or self.memory_shares_only

    @property
    def health(self) -> HealthPolicy | None:
        """The health policy; None with --no-health-monitor."""
        if not self.health_monitor:
            return None
        return HealthPolicy(self.health_xid_severity, self.health_taint_effect, self.health_quiet_period)

    @property
    def simulated_mig_state(self) -> Path | None:
        """Where simulated GPUs keep their MIG instances with --dynamic-mig, so that they outlive
        the plugin as on a GPU (and, like on a GPU, end with the boot: the state dir is a tmpfs)."""
        return self.state / SIMULATED_MIG_STATE if self.simulate is not None and self.dynamic_mig else None
