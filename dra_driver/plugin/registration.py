"""The kubelet plugin registration service (pluginregistration.Registration).

The kubelet finds our registration socket, calls GetInfo, connects to the advertised
DRA endpoint and reports the outcome with NotifyRegistrationStatus. A refusal is
logged as an error and remembered; the plugin keeps running, because the kubelet
retries when the socket is re-created and a crash loop would not help anyone.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import structlog

from dra_driver.kubeletapi.pluginregistration.v1 import api_pb2 as reg
from dra_driver.kubeletapi.pluginregistration.v1 import api_pb2_grpc as reg_grpc

log = structlog.get_logger(__name__)

# DRAPlugin v1 alone: every kubelet this driver runs under (1.34 and later, which it needs
# for resource.k8s.io/v1) speaks it and picks it. The health services are advertised so that
# a 1.37 kubelet opens the health stream (preferring v1); 1.34 and 1.35 speak v1alpha1 only.
SUPPORTED_SERVICES = (
    "v1.DRAPlugin",
    "v1.DRAResourceHealth",
    "v1alpha1.DRAResourceHealth",
)


class RegistrationService:
    def __init__(self, driver: str, endpoint: str) -> None:
        self._driver = driver
        self._endpoint = endpoint
        self.registered = asyncio.Event()
        self.last_error: str | None = None

    async def GetInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        log.info("kubelet asked for plugin info", endpoint=self._endpoint)
        return reg.PluginInfo(
            type="DRAPlugin",
            name=self._driver,
            endpoint=self._endpoint,
            supported_versions=list(SUPPORTED_SERVICES),
        )

    async def NotifyRegistrationStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.plugin_registered:
            self.last_error = None
            self.registered.set()
            log.info("registered with the kubelet")
        else:
            self.last_error = request.error
            self.registered.clear()
            log.error("the kubelet refused the registration", error=request.error)
        return reg.RegistrationStatusResponse()


def add_registration(server: grpc.aio.Server, service: RegistrationService) -> None:
    reg_grpc.add_RegistrationServicer_to_server(service, server)
