"""The kubelet-facing gRPC services: DRA v1 and v1beta1, health v1 and v1alpha1.

Translation only: protobuf in, domain calls, protobuf out; grpcio serves them
(dra_driver.plugin.server). Each claim of a request is answered on its own (one bad claim
never fails its neighbours; a failure of the whole batch is still answered claim by
claim), with an error of at most MAX_ERROR characters, and every log line about a claim
carries its namespace, name and UID. The work itself is done by a `ClaimPreparer`; each
claim's new state goes to the `StatusQueue` here, in one place, which writes it after the
answer was sent (grpc ends the call, then the queue may start). This module holds no state
of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from types import ModuleType
from typing import Any, Final, Protocol

import grpc
import structlog

from dra_driver import metrics
from dra_driver.jsontypes import JSON
from dra_driver.kubeletapi.dra.v1 import api_pb2 as dra_v1
from dra_driver.kubeletapi.dra.v1 import api_pb2_grpc as dra_v1_grpc
from dra_driver.kubeletapi.dra.v1beta1 import api_pb2 as dra_v1beta1
from dra_driver.kubeletapi.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from dra_driver.kubeletapi.drahealth.v1 import api_pb2 as health_v1
from dra_driver.kubeletapi.drahealth.v1 import api_pb2_grpc as health_v1_grpc
from dra_driver.kubeletapi.drahealth.v1alpha1 import api_pb2 as health_v1alpha1
from dra_driver.kubeletapi.drahealth.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from dra_driver.plugin.claims import ClaimRef, describe
from dra_driver.plugin.health import DeviceHealthBoard
from dra_driver.plugin.prepared import PreparedDevice
from dra_driver.plugin.state import ClaimResult

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
    """NodePrepareResources/NodeUnprepareResources for one API version's messages."""

    def __init__(
        self, preparer: ClaimPreparer, pb: ModuleType, with_share_id: bool, status: StatusQueue | None = None
    ) -> None:
        self._preparer = preparer
        self._pb = pb
        self._with_share_id = with_share_id
        self._status = status

    def _report(self, context: grpc.aio.ServicerContext, verb: str) -> Callable[[ClaimRef, ClaimResult], Any]:
        """What tells the status queue each claim's new state; the queue writes nothing
        before this call's answer was sent (grpc runs done callbacks at the RPC's end)."""
        status = self._status
        if status is None:
            return lambda ref, result: None
        status.call_started()
        context.add_done_callback(lambda _: status.call_ended())
        if verb == "prepare":
            return lambda ref, result: status.prepared(ref, result.devices, result.claim)
        return lambda ref, result: status.unprepared(ref)

    async def NodePrepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse_too_many(request, context, "NodePrepareResources")

        def answer(result: ClaimResult) -> Any:
            if result.error is not None:
                return self._pb.NodePrepareResourceResponse(error=_bounded(result.error))
            log.info("prepared", devices=[d.device for d in result.devices])
            return self._pb.NodePrepareResourceResponse(devices=[self._device(d) for d in result.devices])

        report = self._report(context, "prepare")
        claims = await _per_claim(self._preparer.prepare, request, "prepare", answer, report)
        return self._pb.NodePrepareResourcesResponse(claims=claims)

    async def NodeUnprepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse_too_many(request, context, "NodeUnprepareResources")

        def answer(result: ClaimResult) -> Any:
            if result.error is not None:
                return self._pb.NodeUnprepareResourceResponse(error=_bounded(result.error))
            log.info("unprepared")
            return self._pb.NodeUnprepareResourceResponse()

        report = self._report(context, "unprepare")
        claims = await _per_claim(self._preparer.unprepare, request, "unprepare", answer, report)
        return self._pb.NodeUnprepareResourcesResponse(claims=claims)

    def _device(self, d: PreparedDevice) -> Any:
        fields: dict[str, Any] = {
            "request_names": list(d.request_names),
            "pool_name": d.pool,
            "device_name": d.device,
            "cdi_device_ids": list(d.cdi_device_ids),
        }
        if self._with_share_id and d.share_id is not None:
            fields["share_id"] = d.share_id
        return self._pb.Device(**fields)


async def _refuse_too_many(request: Any, context: grpc.aio.ServicerContext, call: str) -> None:
    """One log line and INVALID_ARGUMENT for a call naming more than MAX_CLAIMS claims."""
    if len(request.claims) > MAX_CLAIMS:
        message = (f"{call} names {len(request.claims)} claims, more than the {MAX_CLAIMS} a node can hold; "
                   "refused without reading them")
        log.warning("call refused", call=call, claims=len(request.claims), max_claims=MAX_CLAIMS)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


def _bounded(error: str) -> str:
    return error if len(error) <= MAX_ERROR else error[: MAX_ERROR - 15] + " ... (truncated)"


async def _per_claim(
    call: Callable[[Sequence[ClaimRef]], Awaitable[dict[str, ClaimResult]]],
    request: Any,
    verb: str,
    answer: Callable[[ClaimResult], Any],
    report: Callable[[ClaimRef, ClaimResult], Any],
) -> dict[str, Any]:
    """Each claim of the request's answer, by UID, logged with the claim's identity; each
    claim done is reported to the status queue."""
    refs = [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]
    if not refs:  # the liveness probe's call; the kubelet never sends an empty one
        return {}
    with metrics.timed_request("prepare" if verb == "prepare" else "unprepare") as outcomes:
        results = await _answer_all(call, refs, f"{verb[:-1]}ing")
        outcomes.extend("success" if results[r.uid].error is None else "error" for r in refs)
    claims = {}
    for ref in refs:
        with structlog.contextvars.bound_contextvars(**ref.log_fields()):
            result = results[ref.uid]
            if result.error is not None:
                log.warning(f"{verb} refused", error=result.error)
            else:
                report(ref, result)
            claims[ref.uid] = answer(result)
    return claims


async def _answer_all(
    call: Callable[[Sequence[ClaimRef]], Awaitable[dict[str, ClaimResult]]], refs: list[ClaimRef], doing: str
) -> dict[str, ClaimResult]:
    """Every claim gets an answer, even if the preparer itself failed (the kubelet retries
    claims that are missing from the map, but a user reads the error)."""
    try:
        results = await call(refs)
    except Exception as e:
        log.exception(f"{doing} claims failed", claims=len(refs))
        results = {}
        failure = describe(e)
    else:
        failure = "no answer for this claim"
    return {
        r.uid: results.get(r.uid) or ClaimResult(error=f"internal error {doing} claim {r}: {failure}")
        for r in refs
    }


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
    """The DRA socket's services: DRAPlugin v1 and v1beta1, DRAResourceHealth v1 and v1alpha1."""
    dra_v1_grpc.add_DRAPluginServicer_to_server(_DraService(preparer, dra_v1, True, status), server)
    v1beta1 = _DraService(preparer, dra_v1beta1, False, status)
    dra_v1beta1_grpc.add_DRAPluginServicer_to_server(v1beta1, server)
    health_v1_grpc.add_DRAResourceHealthServicer_to_server(_HealthService(board, health_v1), server)
    health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(
        _HealthService(board, health_v1alpha1), server
    )
