"""The kubelet's side of the plugin protocol, for the integration tests and benchmarks.

Finds the plugin's registration socket, calls GetInfo, connects to the advertised DRA
endpoint with the API version the kubelet would pick (the first one in the plugin's
list that it knows) and calls NodePrepareResources / NodeUnprepareResources the way
the kubelet does, from our own generated stubs. It plays the kubelet where no real one
runs: protocol edge cases and fault points that a kubelet cannot produce on demand (the
node tier and `make demo` run real kubelets, tests.harness.node).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from dra_driver.kubeletapi.dra.v1 import api_pb2 as dra_v1
from dra_driver.kubeletapi.dra.v1 import api_pb2_grpc as dra_v1_grpc
from dra_driver.kubeletapi.pluginregistration.v1 import api_pb2 as reg
from dra_driver.kubeletapi.pluginregistration.v1 import api_pb2_grpc as reg_grpc

KNOWN_SERVICES: dict[str, tuple[ModuleType, Any]] = {
    "v1.DRAPlugin": (dra_v1, dra_v1_grpc.DRAPluginStub),
}


@dataclass(frozen=True)
class ClaimName:
    namespace: str
    name: str
    uid: str


def claim_ref(claim: dict[str, Any]) -> ClaimName:
    """The claim as the kubelet names it in a Prepare/Unprepare request."""
    meta = claim["metadata"]
    return ClaimName(meta["namespace"], meta["name"], meta["uid"])


def prepared_cdi_ids(response: Any, uid: str) -> tuple[tuple[str, ...], str]:
    """(CDI device ids, error) for one claim of a NodePrepareResources response."""
    if uid not in response.claims:
        return (), "the plugin's answer has no entry for this claim"
    result = response.claims[uid]
    if result.error:
        return (), str(result.error)
    return tuple(cdi for device in result.devices for cdi in device.cdi_device_ids), ""


def find_registration_socket(kubelet_dir: Path, driver: str, timeout: float = 30.0) -> Path:
    """Wait for a socket of `driver` in the plugin registry, as the kubelet's watcher would."""
    registry = kubelet_dir / "plugins_registry"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = (
            sorted(p for p in registry.glob(f"{driver}*-reg.sock") if p.is_socket())
            if registry.exists()
            else []
        )
        if found:
            return found[-1]
        time.sleep(0.01)  # fine-grained: benchmarks/prepare.py times start-to-registered with it
    raise TimeoutError(f"no registration socket for {driver} appeared in {registry} within {timeout}s")


class KubeletSide:
    """A connected plugin, as the kubelet's DRA manager holds it."""

    def __init__(self, registration_socket: Path, prefer: str | None = None, timeout: float = 45.0) -> None:
        self.timeout = timeout
        with grpc.insecure_channel(f"unix://{registration_socket}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            self.info = stub.GetInfo(reg.InfoRequest(), timeout=timeout)
            offered = list(self.info.supported_versions)
            choices = [prefer] if prefer else offered
            picked = next((s for s in choices if s in KNOWN_SERVICES and s in offered), None)
            if self.info.type != "DRAPlugin" or picked is None:
                error = f"plugin type {self.info.type!r} or services {offered} not usable"
                stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=False, error=error))
                raise RuntimeError(error)
            stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=timeout)
        self.service = picked
        self.pb, stub_class = KNOWN_SERVICES[picked]
        self.channel = grpc.insecure_channel(f"unix://{self.info.endpoint}")
        self.stub = stub_class(self.channel)

    def _claims(self, claims: list[ClaimName]) -> list[Any]:
        return [self.pb.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]

    def prepare(self, *claims: ClaimName) -> Any:
        return self.stub.NodePrepareResources(
            self.pb.NodePrepareResourcesRequest(claims=self._claims(list(claims))), timeout=self.timeout
        )

    def unprepare(self, *claims: ClaimName) -> Any:
        return self.stub.NodeUnprepareResources(
            self.pb.NodeUnprepareResourcesRequest(claims=self._claims(list(claims))), timeout=self.timeout
        )

    def close(self) -> None:
        self.channel.close()
