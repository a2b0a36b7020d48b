"""The kubelet-facing gRPC services: DRA v1, health v1 and v1alpha1.

DRA v1 only: every kubelet this driver runs under (1.34 and later; it needs
resource.k8s.io/v1) picks v1 when the plugin offers it, so a v1beta1 service would never
be called.

Translation only: protobuf in, domain calls, protobuf out; grpcio serves them
(dra_driver.plugin.server). Each claim of a request is answered on its own (one bad claim
never fails its neighbours; a failure of the whole batch is still answered claim by
claim), with an error of at most MAX_ERROR characters, and every log line about a claim
carries its namespace, name and UID. The work itself is done by a `ClaimPreparer`, called
straight from the handler (state.py's docstring lists the frames down to the CDI file and
the checkpoint); each claim's new state goes to the `StatusQueue` from `_answers`, the one
place, which writes it after the answer was sent (grpc ends the call, then the queue may
start). This module holds no state of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from types import ModuleType
from typing import Any, Final, Protocol

import grpc
import structlog

from dra_driver import metrics
from dra_driver.jsontypes import JSON
from dra_driver.kubeletapi.dra.v1 import api_pb2 as dra_v1
from dra_driver.kubeletapi.dra.v1 import api_pb2_grpc as dra_v1_grpc
from dra_driver.kubeletapi.drahealth.v1 import api_pb2 as health_v1
from dra_driver.kubeletapi.drahealth.v1 import api_pb2_grpc as health_v1_grpc
from dra_driver.kubeletapi.drahealth.v1alpha1 import api_pb2 as health_v1alpha1
from dra_driver.kubeletapi.drahealth.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from dra_driver.plugin.claims import ClaimRef, describe
from dra_driver.plugin.health import DeviceHealthBoard
from dra_driver.plugin.prepared import ClaimResult, PreparedDevice

log = structlog.get_logger(__name__)

# A claim's error is read by a user in the pod's events; one longer than this is a bug of
# ours, and a thousand of them must not make the answer too big for the kubelet to take.
MAX_ERROR: Final = 4096
# More claims than a node holds: one claim per device at least, and even a 16-GPU node
# carved into 7 MIG instances each and shared by memory is far below this. A call naming
# more is refused whole at once (its size alone would block the event loop for seconds).
MAX_CLAIMS: Final = 1024


class ClaimPreparer(Protocol):
    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]: ...

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]: ...


class StatusQueue(Protocol):
    """Where the claims' new states go (dra_driver.plugin.claim_status.ClaimStatus)."""

    def call_started(self) -> None: ...

    def call_ended(self) -> None: ...

    def prepared(self, ref: ClaimRef, devices: Sequence[PreparedDevice], claim: JSON | None) -> None: ...

    def unprepared(self, ref: ClaimRef) -> None: ...


class _DraService:
    """NodePrepareResources/NodeUnprepareResources."""

    def __init__(self, preparer: ClaimPreparer, status: StatusQueue | None = None) -> None:
        self._preparer = preparer
        self._status = status

    async def NodePrepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        refs = await self._refs(request, context, "NodePrepareResources")
        if not refs:  # the liveness probe's call; the kubelet never sends an empty one
            return dra_v1.NodePrepareResourcesResponse()
        with metrics.timed_request("prepare") as outcomes:
            try:
                results = await self._preparer.prepare(refs)
            except Exception as e:
                log.exception("preparing claims failed", claims=len(refs))
                results = _failed(refs, "preparing", describe(e))
            outcomes.extend(_outcomes(refs, results))
        return dra_v1.NodePrepareResourcesResponse(claims=self._answers(refs, results, "prepare"))

    async def NodeUnprepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        refs = await self._refs(request, context, "NodeUnprepareResources")
        if not refs:
            return dra_v1.NodeUnprepareResourcesResponse()
        with metrics.timed_request("unprepare") as outcomes:
            try:
                results = await self._preparer.unprepare(refs)
            except Exception as e:
                log.exception("unpreparing claims failed", claims=len(refs))
                results = _failed(refs, "unpreparing", describe(e))
            outcomes.extend(_outcomes(refs, results))
        return dra_v1.NodeUnprepareResourcesResponse(claims=self._answers(refs, results, "unprepare"))

    async def _refs(self, request: Any, context: grpc.aio.ServicerContext, call: str) -> list[ClaimRef]:
        """The request's claims; a call naming more than MAX_CLAIMS is refused whole (one log
        line, INVALID_ARGUMENT). The status queue writes nothing before this call's answer was
        sent (grpc runs done callbacks at the RPC's end)."""
        if len(request.claims) > MAX_CLAIMS:
            message = (f"{call} names {len(request.claims)} claims, more than the {MAX_CLAIMS} a node can "
                       "hold; refused without reading them")
            log.warning("call refused", call=call, claims=len(request.claims), max_claims=MAX_CLAIMS)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        status = self._status
        if status is not None:
            status.call_started()
            context.add_done_callback(lambda _: status.call_ended())
        return [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]

    def _answers(
        self, refs: Sequence[ClaimRef], results: Mapping[str, ClaimResult], verb: str
    ) -> dict[str, Any]:
        """Each claim's answer, logged with its identity; and the one place each claim's new
        state goes to the status queue. A claim the preparer left without an answer gets an
        error (the kubelet retries claims missing from the map, but a user reads the error)."""
        answers = {}
        for ref in refs:
            result = results.get(ref.uid) or ClaimResult(
                error=f"internal error {verb[:-1]}ing claim {ref}: no answer for this claim")
            if result.error is not None:
                log.warning(f"{verb} refused", error=result.error, **ref.log_fields())
                error = _bounded(result.error)
                answers[ref.uid] = (dra_v1.NodePrepareResourceResponse(error=error) if verb == "prepare"
                                    else dra_v1.NodeUnprepareResourceResponse(error=error))
            elif verb == "prepare":
                log.info("prepared", devices=[d.device for d in result.devices], **ref.log_fields())
                if self._status is not None:
                    self._status.prepared(ref, result.devices, result.claim)
                devices = [self._device(d) for d in result.devices]
                answers[ref.uid] = dra_v1.NodePrepareResourceResponse(devices=devices)
            else:
                log.info("unprepared", **ref.log_fields())
                if self._status is not None:
                    self._status.unprepared(ref)
                answers[ref.uid] = dra_v1.NodeUnprepareResourceResponse()
        return answers

    def _device(self, d: PreparedDevice) -> Any:
        fields: dict[str, Any] = {
            "request_names": list(d.request_names),
            "pool_name": d.pool,
            "device_name": d.device,
            "cdi_device_ids": list(d.cdi_device_ids),
        }
        if d.share_id is not None:
            fields["share_id"] = d.share_id
        return dra_v1.Device(**fields)


def _bounded(error: str) -> str:
    return error if len(error) <= MAX_ERROR else error[: MAX_ERROR - 15] + " ... (truncated)"


def _failed(refs: Sequence[ClaimRef], doing: str, failure: str) -> dict[str, ClaimResult]:
    """Every claim's answer when the preparer itself failed."""
    return {r.uid: ClaimResult(error=f"internal error {doing} claim {r}: {failure}") for r in refs}


def _outcomes(refs: Sequence[ClaimRef], results: Mapping[str, ClaimResult]) -> list[str]:
    return ["success" if (r.uid in results and results[r.uid].error is None) else "error" for r in refs]


class _HealthService:
    """NodeWatchResources: the complete device list, then again on every change."""

    def __init__(self, board: DeviceHealthBoard, pb: ModuleType) -> None:
        self._board = board
        self._pb = pb

    async def NodeWatchResources(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for snapshot in self._board.follow():
            yield self._pb.NodeWatchResourcesResponse(
                devices=[
                    self._pb.DeviceHealth(
                        device=self._pb.DeviceIdentifier(pool_name=h.pool, device_name=h.device),
                        health=self._pb.HealthStatus.Value(h.status),
                        last_updated_time=int(h.updated),
                        health_check_timeout_seconds=h.timeout_seconds,
                        message=h.message[:1024],
                    )
                    for h in snapshot
                ]
            )


def add_dra_services(
    server: grpc.aio.Server,
    preparer: ClaimPreparer,
    board: DeviceHealthBoard,
    status: StatusQueue | None = None,
) -> None:
    """The DRA socket's services: DRAPlugin v1, DRAResourceHealth v1 and v1alpha1."""
    dra_v1_grpc.add_DRAPluginServicer_to_server(_DraService(preparer, status), server)
    health_v1_grpc.add_DRAResourceHealthServicer_to_server(_HealthService(board, health_v1), server)
    health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(
        _HealthService(board, health_v1alpha1), server
    )
