"""The NVML event loop: one thread that waits on an NVML event set for every GPU and
checks each GPU now and then; it hands what it saw to a callback in batches.

The same code runs on `pynvml` and on `FakeNvml` (dra_driver.gpu.sim.fake_nvml), whose event
wait is fed by injected events. Rules kept here:
- register every health event type NVML offers on a GPU (`WANTED`, masked by
  `nvmlDeviceGetSupportedEventTypes`); what a GPU does not offer is said once, at start;
- never block the caller: the wait (a C call that releases the GIL) runs in this thread;
  events are coalesced (identical ones counted) and delivered at most once per
  `batch_window`, so a storm of thousands per second costs the event loop a few calls;
- keep up with any storm NVML can raise: NVML hands events over one wait at a time, in
  order, so a fatal XID behind a storm is only as late as the storm's backlog. An event
  therefore costs one wait and one count: the GPU is found from the handle NVML returns
  (mapped once, at registration; no `nvmlDeviceGetUUID` per event) and an event is a key
  in a counter until its batch goes out (no record per event). A batch with an event that
  is not the same as the one before goes out after `batch_window` at most; a run of
  identical events in one batch costs a single record;
- every `probe_interval` seconds, and at once after NVML says a GPU is lost, each GPU is
  checked: can NVML still reach it (memory info), and which recovery action does NVML ask
  for (field 230, where offered; a new action once two checks in a row read it). The check
  never waits behind NVML's event queue, so behind any storm it sees a fatal XID's action.
  Checks that find every GPU well are handed over once after any events, not every time;
- `alive_at` moves on every turn of the loop, so a wedged NVML call shows (the health
  stream then stops vouching for the devices and the kubelet marks them Unknown).

It must NOT classify events or touch Kubernetes: that is `classify`/`keeper`'s work.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import pynvml
import structlog

from dra_driver.health.classify import UNKNOWN_XID_SEVERITY, XID_TABLE
from dra_driver.health.events import WHOLE_GPU, EventKind, HealthEvent, MonitorFacts, Probe

log = structlog.get_logger(__name__)

RECOVERY_ACTION_FIELD: Final = int(getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", 230))

# NVML event type bit -> kind; constants missing from an older nvidia-ml-py are left out.
WANTED: Final[dict[int, EventKind]] = {
    int(getattr(pynvml, name)): kind
    for name, kind in (
        ("nvmlEventTypeXidCriticalError", EventKind.XID),
        ("nvmlEventTypeDoubleBitEccError", EventKind.DOUBLE_BIT_ECC),
        ("nvmlEventTypeSingleBitEccError", EventKind.SINGLE_BIT_ECC),
        ("nvmlEventTypeSingleBitEccErrorStorm", EventKind.SINGLE_BIT_ECC_STORM),
        ("nvmlEventTypeDramRetirementEvent", EventKind.DRAM_RETIREMENT),
        ("nvmlEventTypeDramRetirementFailure", EventKind.DRAM_RETIREMENT_FAILURE),
        ("nvmlEventTypeNonFatalPoisonError", EventKind.NON_FATAL_POISON),
        ("nvmlEventTypeFatalPoisonError", EventKind.FATAL_POISON),
        ("nvmlEventTypeGpuUnavailableError", EventKind.GPU_UNAVAILABLE),
        ("nvmlEventTypeGpuRecoveryAction", EventKind.RECOVERY_ACTION),
    )
    if hasattr(pynvml, name)
}

_VALUE_FIELDS: Final = {
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
_LOST: Final = frozenset({pynvml.NVML_ERROR_GPU_IS_LOST})
_NO_RECOVERY_ACTION: Final = int(getattr(pynvml, "NVML_GPU_RECOVERY_ACTION_NONE", 0))
_UNSEEN: Final = -1  # a handle not mapped to a GPU (or to None, "not ours") yet
_NOT_OFFERED: Final = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
    }
)


class NvmlEventsApi(Protocol):
    """The pynvml calls the monitor makes; `pynvml` and `FakeNvml` both provide them."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None: ...
    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any: ...
    def nvmlEventSetFree(self, event_set: Any) -> None: ...
    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list[int]) -> Any: ...


class HealthMonitorError(Exception):
    """NVML cannot be used for health monitoring at all (no driver, init failed)."""


@dataclass(frozen=True)
class GpuRef:
    """A GPU of the inventory: its index and the UUIDs NVML may name it (or its MIG devices) by."""

    index: int
    uuid: str
    mig_uuids: tuple[str, ...] = ()


Batch = Sequence[HealthEvent | Probe]
# One NVML event as the loop counts it: (GPU index, event type bit, data, GPU instance, compute instance).
EventKey = tuple[int, int, int, int, int]


def handle_key(handle: Any) -> Hashable:
    """What identifies a device handle across calls: pynvml returns a new ctypes pointer object
    for the same device each time, so its address; FakeNvml's handles are plain values."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle  # type: ignore[no-any-return]


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _kinds(mask: int) -> tuple[str, ...]:
    return tuple(str(kind) for bit, kind in WANTED.items() if mask & bit)


def _field_value(value: Any) -> int | None:
    """The integer in an NVML field value, or None when NVML did not answer that field."""
    if value.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    attribute = _VALUE_FIELDS.get(value.valueType)
    return int(getattr(value.value, attribute)) if attribute else None


class NvmlHealthMonitor:
    """Watches the GPUs of `gpus` through `nvml` and calls `deliver` (from its own thread) with batches."""

    def __init__(
        self,
        nvml: NvmlEventsApi,
        gpus: Sequence[GpuRef],
        deliver: Callable[[Batch], None],
        *,
        wait_ms: int = 1000,
        probe_interval: float = 5.0,
        batch_window: float = 0.05,
        max_batch: int = 10_000,
        clock: Callable[[], float] = time.time,
        count_wait: Callable[[str], None] | None = None,
    ) -> None:
        self._nvml = nvml
        self._gpus = {g.index: g for g in gpus}
        self._by_uuid = {u: g.index for g in gpus for u in (g.uuid, *g.mig_uuids)}
        self._deliver = deliver
        self._wait_ms = wait_ms
        self._probe_interval = probe_interval
        self._batch_window = batch_window
        self._max_batch = max_batch
        self._clock = clock
        self._handles: dict[int, Any] = {}
        self._gpu_of_handle: dict[Hashable, int | None] = {}  # handle_key -> GPU index; None: not ours
        self._field_offered: dict[int, bool] = {}
        # The recovery action of each GPU as last read, and as last read twice in a row (reported).
        self._action_read: dict[int, int | None] = {}
        self._action_held: dict[int, int | None] = {}
        self._event_set: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._probe_now = threading.Event()
        self._said: set[str] = set()
        self._well_delivered = False  # the last checks handed over were all well, no events since
        self.alive_at = time.monotonic()
        self.facts = MonitorFacts({}, {}, {})
        self.delivered_events = 0  # NVML events seen (before coalescing), for benchmarks and tests
        # How each NVML wait ended (timeout, event, ignored, lost, error): a quiet node times
        # out once per check, so anything more says what keeps the thread busy (a metric).
        self._count_wait = count_wait or (lambda result: None)

    # -- start and stop ------------------------------------------------------------------------

    def start(self) -> MonitorFacts:
        """Initialize NVML, register the event types of every GPU and start the thread."""
        try:
            self._nvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise HealthMonitorError(f"NVML could not be initialized for health monitoring: {err}") from err
        try:
            self._event_set = self._nvml.nvmlEventSetCreate()
            self.facts = self._register()
        except Exception:
            self._shutdown()
            raise
        self._thread = threading.Thread(target=self._run, name="nvml-health", daemon=True)
        self._thread.start()
        return self.facts

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (within one wait) and release the event set and NVML."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("NVML health thread did not stop in time; leaving it", timeout=timeout)
                return
        self._shutdown()

    def _shutdown(self) -> None:
        if self._event_set is not None:
            self._call_quietly("nvmlEventSetFree", self._nvml.nvmlEventSetFree, self._event_set)
            self._event_set = None
        self._call_quietly("nvmlShutdown", self._nvml.nvmlShutdown)

    def _call_quietly(self, what: str, call: Callable[..., Any], *args: Any) -> None:
        try:
            call(*args)
        except pynvml.NVMLError as err:
            log.warning("NVML call failed while stopping the health monitor", call=what, error=str(err))

    def _register(self) -> MonitorFacts:
        wanted = sum(WANTED)
        registered: dict[int, tuple[str, ...]] = {}
        unsupported: dict[int, tuple[str, ...]] = {}
        for index, gpu in sorted(self._gpus.items()):
            handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(self._nvml.nvmlDeviceGetUUID(handle))
            if uuid != gpu.uuid:
                raise HealthMonitorError(
                    f"NVML's GPU {index} is {uuid}, the inventory's is {gpu.uuid}: the GPUs changed since "
                    "discovery; restart the plugin"
                )
            self._handles[index] = handle
            self._gpu_of_handle[handle_key(handle)] = index
            try:
                supported = int(self._nvml.nvmlDeviceGetSupportedEventTypes(handle))
            except pynvml.NVMLError as err:
                log.warning("NVML cannot say which events GPU offers; watching by periodic checks only",
                            gpu=index, error=str(err))
                supported = 0
            mask = self._register_gpu(index, handle, wanted & supported)
            registered[index] = _kinds(mask)
            unsupported[index] = _kinds(wanted & ~mask)
            action = self._read_recovery_action(index, handle, at_start=True)
            self._field_offered[index] = action is not None
            self._action_read[index] = self._action_held[index] = action
            log.info(
                "health monitor watching GPU",
                gpu=index,
                uuid=gpu.uuid,
                registered=list(registered[index]),
                not_offered=list(unsupported[index]),
                recovery_action_field=self._field_offered[index],
            )
        return MonitorFacts(registered, unsupported, dict(self._field_offered))

    def _register_gpu(self, index: int, handle: Any, mask: int) -> int:
        if not mask:
            return 0
        try:
            self._nvml.nvmlDeviceRegisterEvents(handle, mask, self._event_set)
            return mask
        except pynvml.NVMLError as err:
            log.info("registering the event types at once failed; trying one by one", gpu=index,
                     error=str(err))
        done = 0
        for bit in (b for b in WANTED if mask & b):
            try:
                self._nvml.nvmlDeviceRegisterEvents(handle, bit, self._event_set)
                done |= bit
            except pynvml.NVMLError:
                continue
        return done

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        pending: dict[EventKey, int] = {}  # coalesced: each distinct event and how often it came
        first_at = 0.0  # monotonic time of the batch's first event
        last_at = 0.0  # wall clock of the batch's last event
        next_probe = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            self.alive_at = now
            if self._probe_now.is_set():
                self._probe_now.clear()
                next_probe = now
            if pending:
                timeout = max(0.0, first_at + self._batch_window - now)
            else:
                timeout = min(self._wait_ms / 1000, max(0.0, next_probe - now))
            # Rounded up: a wait cut to whole milliseconds ends just before the check is due,
            # and a remainder below 1 ms rounded down is a wait of 0, again and again until it is.
            key = self._wait(math.ceil(timeout * 1000))
            if key is not None:
                if not pending:
                    first_at = time.monotonic()
                pending[key] = pending.get(key, 0) + 1
                last_at = self._clock()
                self.delivered_events += 1
            now = time.monotonic()
            probe_due = now >= next_probe
            # Events go out before a probe, so that a check never overtakes the event that explains it.
            batch_due = len(pending) >= self._max_batch or now - first_at >= self._batch_window
            if pending and (probe_due or batch_due):
                self._flush(pending, last_at)
                pending = {}
            if probe_due:
                self._deliver_checks(self._probe_all())
                next_probe = time.monotonic() + self._probe_interval
        if pending:
            self._flush(pending, last_at)

    def _wait(self, timeout_ms: int) -> EventKey | None:
        try:
            data = self._nvml.nvmlEventSetWait_v2(self._event_set, timeout_ms)
        except pynvml.NVMLError as err:
            if err.value == pynvml.NVML_ERROR_TIMEOUT:
                self._count_wait("timeout")
                return None
            if err.value in _LOST:
                self._count_wait("lost")
                self._say_once("lost", "NVML event wait says a GPU is lost; checking every GPU", log.warning)
                self._probe_now.set()
                return None
            self._count_wait("error")
            self._say_once(f"wait-{err.value}", "NVML event wait failed; retrying", log.warning,
                           error=str(err))
            self._stop.wait(0.5)
            return None
        key = self._key(data)
        self._count_wait("ignored" if key is None else "event")
        return key

    def _key(self, data: Any) -> EventKey | None:
        """The event's key, or None for one that is not ours or not of a kind asked for."""
        event_type = int(data.eventType)
        handle = handle_key(data.device)
        gpu = self._gpu_of_handle.get(handle, _UNSEEN)
        if gpu == _UNSEEN:
            gpu = self._attribute(data.device)
            if gpu == _UNSEEN:
                return None
            self._gpu_of_handle[handle] = gpu
        if gpu is None or event_type not in WANTED:
            if gpu is not None:
                self._say_once(f"unknown-type-{event_type}", "NVML event of a type not asked for ignored",
                               log.info, gpu=gpu, event_type=event_type)
            return None
        return gpu, event_type, int(data.eventData), int(data.gpuInstanceId), int(data.computeInstanceId)

    def _attribute(self, handle: Any) -> int | None:
        """The GPU index of a handle not seen at registration (a MIG device's, say), by its UUID."""
        try:
            uuid = _text(self._nvml.nvmlDeviceGetUUID(handle))
        except pynvml.NVMLError as err:
            self._say_once("unattributed", "NVML event for a GPU NVML cannot name; checking every GPU",
                           log.warning, error=str(err))
            self._probe_now.set()
            return _UNSEEN  # not remembered: asked again next time
        gpu = self._by_uuid.get(uuid)
        if gpu is None:
            self._say_once(f"unknown-{uuid}", "NVML events of a GPU not in the inventory ignored", log.info,
                           uuid=uuid)
        return gpu

    def _flush(self, pending: dict[EventKey, int], at: float) -> None:
        actions = {
            gpu: self._read_recovery_action(gpu, self._handles[gpu])
            for gpu in {key[0] for key in pending if WANTED[key[1]] is EventKind.XID}
            if self._field_offered.get(gpu)
        }
        batch = [
            HealthEvent(
                gpu=gpu,
                kind=WANTED[event_type],
                data=data,
                gpu_instance=None if gi == WHOLE_GPU else gi,
                compute_instance=None if ci == WHOLE_GPU else ci,
                recovery_action=actions.get(gpu),
                count=n,
                at=at,
            )
            for (gpu, event_type, data, gi, ci), n in pending.items()
        ]
        # The XIDs of one window share the GPU's recovery action: the one the table rates
        # most severe goes first, so that it, not a lesser XID of the window, names the taint.
        batch.sort(key=lambda e: -XID_TABLE.get(e.data, UNKNOWN_XID_SEVERITY) if e.kind is EventKind.XID
                   else 0)
        self._deliver_safely(batch)
        self._well_delivered = False  # the events may have started conditions: the next checks go out

    def _deliver_checks(self, probes: list[Probe]) -> None:
        """Hand the checks over, unless every GPU answered and NVML asks for no recovery
        action on any, and the keeper has had that news since the last events: it then changes
        nothing (a well check only starts a condition's quiet period, which the first one after
        the events did), and a quiet node spares its event loop a batch every check."""
        well = all(not p.lost and p.recovery_action in (None, _NO_RECOVERY_ACTION) for p in probes)
        if well and self._well_delivered:
            return
        self._deliver_safely(probes)
        self._well_delivered = well

    def _deliver_safely(self, batch: Batch) -> None:
        try:
            self._deliver(batch)
        except Exception:
            # The receiver (the event loop) may be shutting down; the monitor stops next turn.
            log.exception("health batch could not be delivered")

    # -- the periodic check ------------------------------------------------------------------

    def _probe_all(self) -> list[Probe]:
        return [self._probe(index, handle) for index, handle in sorted(self._handles.items())]

    def _probe(self, index: int, handle: Any) -> Probe:
        try:
            self._nvml.nvmlDeviceGetMemoryInfo(handle)
        except pynvml.NVMLError as err:
            if err.value in _LOST:
                return Probe(index, lost=True, recovery_action=None, at=self._clock())
            self._say_once(f"probe-{index}-{err.value}", "NVML check of GPU failed", log.warning,
                           gpu=index, error=str(err))
        action = self._read_recovery_action(index, handle) if self._field_offered.get(index) else None
        return Probe(index, lost=False, recovery_action=self._held(index, action), at=self._clock())

    def _held(self, index: int, action: int | None) -> int | None:
        """The recovery action the check reports: a new value once two checks in a row read it.
        NVML sets the action with the XID that calls for it, and that XID's event reaches the
        keeper within a batch window, naming the cause, unless a storm's backlog is ahead of
        it in NVML's queue; the check, which never waits behind the queue, then reports the
        action one interval later."""
        previous, self._action_read[index] = self._action_read.get(index), action
        if action == previous:
            self._action_held[index] = action
        return self._action_held.get(index)

    def _read_recovery_action(self, index: int, handle: Any, at_start: bool = False) -> int | None:
        try:
            values = self._nvml.nvmlDeviceGetFieldValues(handle, [RECOVERY_ACTION_FIELD])
        except pynvml.NVMLError as err:
            if not at_start and err.value not in _NOT_OFFERED | _LOST:
                self._say_once(f"field-{index}", "NVML recovery-action query failed", log.warning,
                               gpu=index, error=str(err))
            return None
        return _field_value(values[0])

    def _say_once(self, key: str, message: str, emit: Callable[..., Any], **fields: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            emit(message, **fields)
