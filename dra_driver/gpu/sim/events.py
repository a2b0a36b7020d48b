"""The simulated GPUs' health events: what `FakeNvml`'s event wait returns (`dra_driver.gpu.sim.fake_nvml`).

A `FakeEventSource` holds the simulated condition of each GPU (lost or not, the recovery
action NVML would report) and a queue of pending NVML events. Tests and people feed it
in-process (`inject(record)`) or by appending JSON lines to a control file, which a running
`dra-driver kubelet-plugin --simulate` follows only when named by `--simulate-health-events`:

    {"gpu": 0, "xid": 79}                                   one XID event
    {"gpu": 0, "xid": 79, "recovery_action": 1}             ... with NVML's recovery action set first
    {"gpu": 0, "xid": 13, "repeat": 20000, "per_second": 5000}   a storm, spread over 4 s
    {"gpu": 0, "event": "double-bit-ecc"}                   any kind of WANTED_BY_NAME
    {"gpu": 0, "gpu_instance": 1, "compute_instance": 0, "xid": 94}   MIG-scoped
    {"gpu": 0, "lost": true}                                the GPU falls off the bus
    {"gpu": 0, "recover": true}                             reset done: reachable, recovery action none

Lines already in the file when the source starts only set the GPUs' condition (a restarted
plugin sees the GPU as the hardware left it); their events are not replayed. A bad line is
logged with what to fix and skipped.

Whoever can write the control file can taint every simulated GPU, so the file is read only
while it is a regular file (no symlink) owned by the plugin's own user (root in the pod)
with no access for group or others (0600: the plugin creates it so when it is missing), of
at most MAX_FILE_BYTES, with lines of at most MAX_LINE_BYTES; otherwise it is refused, and
the log says why and what to run, once per reason. It lives beside the simulated GPU, below the health
package: it must NOT import `dra_driver.health` nor hold health logic (no severities, no
states); the monitor reads these events through the same NVML calls as real ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pynvml
import structlog

log = structlog.get_logger(__name__)

# Event names of the control file -> NVML event type bits.
WANTED_BY_NAME: Final[Mapping[str, int]] = {
    name: int(getattr(pynvml, constant))
    for name, constant in (
        ("xid", "nvmlEventTypeXidCriticalError"),
        ("double-bit-ecc", "nvmlEventTypeDoubleBitEccError"),
        ("single-bit-ecc", "nvmlEventTypeSingleBitEccError"),
        ("single-bit-ecc-storm", "nvmlEventTypeSingleBitEccErrorStorm"),
        ("dram-retirement", "nvmlEventTypeDramRetirementEvent"),
        ("dram-retirement-failure", "nvmlEventTypeDramRetirementFailure"),
        ("non-fatal-poison", "nvmlEventTypeNonFatalPoisonError"),
        ("fatal-poison", "nvmlEventTypeFatalPoisonError"),
        ("gpu-unavailable", "nvmlEventTypeGpuUnavailableError"),
        ("recovery-action", "nvmlEventTypeGpuRecoveryAction"),
    )
    if hasattr(pynvml, constant)
}
ALL_EVENTS: Final = sum(WANTED_BY_NAME.values())
WHOLE: Final = 0xFFFFFFFF
POLL_EVERY: Final = 0.001  # seconds between two reads of the control file
MAX_FILE_BYTES: Final = 1 << 20  # a control file holds a test's worth of lines, never more
MAX_LINE_BYTES: Final = 4096
_KEYS: Final = frozenset(
    {"gpu", "xid", "event", "data", "recovery_action", "repeat", "per_second", "gpu_instance",
     "compute_instance", "lost", "recover"}
)


def _problem(path: Path, st: os.stat_result) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        uid = os.geteuid()
        return f"is owned by uid {st.st_uid}, not by the plugin's uid {uid}: chown {uid} {path}"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}; others could inject events: chmod 600 {path}"
    if st.st_size > MAX_FILE_BYTES:
        return f"holds {st.st_size} bytes, more than {MAX_FILE_BYTES}: truncate it or name a new file"
    return None


class BadInjection(ValueError):
    """A control record the source cannot use; the message says what to write instead."""


@dataclass(frozen=True)
class EventData:
    """What `nvmlEventSetWait_v2` returns: the fields of pynvml's c_nvmlEventData_t."""

    device: Any
    eventType: int  # NVML's field names
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


@dataclass
class _Stream:
    gpu: int
    event_type: int
    data: int
    gpu_instance: int
    compute_instance: int
    left: int
    start: float
    interval: float  # seconds between two events; 0: all at once
    sent: int = 0

    def due(self) -> float:
        return self.start + self.sent * self.interval


class FakeEventSource:
    """The simulated event stream and condition of `gpu_count` GPUs (thread-safe)."""

    def __init__(self, gpu_count: int, control_file: Path | None = None) -> None:
        self.gpu_count = gpu_count
        self.control_file = control_file
        self.lost: set[int] = set()
        self.recovery_action = dict.fromkeys(range(gpu_count), 0)
        self._streams: deque[_Stream] = deque()
        self._lost_news = False  # the next wait reports GPU_IS_LOST once
        self._lock = threading.Lock()
        self._offset = 0
        self._partial = b""
        self._polled_at = 0.0
        self._read_to: tuple[int, int] | None = None  # (inode, size) of the file when read to its end
        self._refused = ""
        if control_file is not None:
            # created here so that it starts out as it must be: ours, 0600
            with contextlib.suppress(FileExistsError):
                os.close(os.open(control_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            data = self._read(0)
            complete = data[: data.rfind(b"\n") + 1]
            for number, line in enumerate(complete.decode(errors="replace").splitlines(), 1):
                self._line(line, f"{control_file}:{number}", replay=True)
            self._offset = len(complete)

    # -- input ---------------------------------------------------------------------------------

    def inject(self, record: Mapping[str, Any]) -> None:
        """Apply one control record now. Raises BadInjection for a record it cannot use."""
        self._apply(record, replay=False)

    def _line(self, line: str, where: str, replay: bool) -> None:
        if not line.strip():
            return
        if len(line) > MAX_LINE_BYTES:
            log.warning("simulated health event skipped", where=where, line=line[:200],
                        problem=f"a line longer than {MAX_LINE_BYTES} bytes")
            return
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise BadInjection("a line must be one JSON object")
            self._apply(record, replay)
        except (ValueError, BadInjection) as err:
            log.warning("simulated health event skipped", where=where, line=line[:200], problem=str(err))

    def poll(self, min_interval: float = 0.0) -> None:
        """Read the lines appended to the control file since the last read, unless that read
        was less than `min_interval` seconds ago (FakeNvml's event wait, called once per
        event, passes POLL_EVERY: opening the file 10,000 times a second would make the
        simulation, not the monitor, what a storm costs)."""
        if self.control_file is None:
            return
        now = time.monotonic()
        if now - self._polled_at < min_interval:
            return
        self._polled_at = now
        try:  # one stat, not an open, while nothing was appended (the idle wait's every turn)
            seen = os.stat(self.control_file, follow_symlinks=False)
        except OSError:
            seen = None
        if seen is not None and (seen.st_ino, seen.st_size) == self._read_to:
            return
        data = self._read(self._offset)
        if seen is not None and seen.st_size == self._offset + len(data):
            self._read_to = (seen.st_ino, seen.st_size)
        if not data:
            return
        self._offset += len(data)
        data = self._partial + data
        complete, _, self._partial = data.rpartition(b"\n")
        if len(self._partial) > MAX_LINE_BYTES:
            log.warning("simulated health event skipped", where=str(self.control_file),
                        problem=f"a line longer than {MAX_LINE_BYTES} bytes")
            self._partial = b""
        for line in complete.decode(errors="replace").splitlines():
            self._line(line, str(self.control_file), replay=False)

    def _read(self, offset: int) -> bytes:
        """What the control file holds from `offset`, checked on the open file itself (so that
        a file swapped in between is checked too); b"" when it is missing or refused."""
        assert self.control_file is not None
        try:
            fd = os.open(self.control_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return b""
        except OSError as e:
            problem: str | None = f"cannot be opened without following a link ({e.strerror})"
        else:
            with os.fdopen(fd, "rb") as f:
                problem = _problem(self.control_file, os.fstat(f.fileno()))
                if problem is None:
                    self._refused = ""
                    f.seek(offset)
                    return f.read(MAX_FILE_BYTES)
        if problem != self._refused:  # once per reason, not once per poll
            log.error("simulated health control file refused", path=str(self.control_file), problem=problem)
            self._refused = problem or ""
        return b""

    def _apply(self, record: Mapping[str, Any], replay: bool) -> None:
        unknown = set(record) - _KEYS
        if unknown:
            raise BadInjection(f"unknown keys {sorted(unknown)}; known: {sorted(_KEYS)}")
        gpu = record.get("gpu")
        if not isinstance(gpu, int) or not 0 <= gpu < self.gpu_count:
            raise BadInjection(f"'gpu' must be a GPU index from 0 to {self.gpu_count - 1}, not {gpu!r}")
        stream = None if replay else self._stream(gpu, record)
        with self._lock:
            if record.get("recover"):
                self.lost.discard(gpu)
                self.recovery_action[gpu] = 0
            if "recovery_action" in record:
                self.recovery_action[gpu] = _int(record, "recovery_action")
            if record.get("lost"):
                self.lost.add(gpu)
                self._lost_news = not replay
            if stream is not None:
                self._streams.append(stream)

    def _stream(self, gpu: int, record: Mapping[str, Any]) -> _Stream | None:
        if "xid" in record:
            event_type, data = WANTED_BY_NAME["xid"], _int(record, "xid")
        elif "event" in record:
            name = record["event"]
            if name not in WANTED_BY_NAME:
                raise BadInjection(f"'event' must be one of {sorted(WANTED_BY_NAME)}, not {name!r}")
            event_type, data = WANTED_BY_NAME[name], _int(record, "data", 0)
        elif "recovery_action" in record and not record.get("recover"):
            event_type, data = WANTED_BY_NAME["recovery-action"], _int(record, "recovery_action")
        else:
            return None
        repeat = _int(record, "repeat", 1)
        per_second = record.get("per_second")
        bad_rate = per_second is not None and (not isinstance(per_second, int | float) or per_second <= 0)
        if repeat < 1 or bad_rate:
            raise BadInjection("'repeat' must be at least 1 and 'per_second' a positive number")
        return _Stream(
            gpu, event_type, data,
            _int(record, "gpu_instance", WHOLE), _int(record, "compute_instance", WHOLE),
            left=repeat, start=time.monotonic(), interval=1 / per_second if per_second else 0.0,
        )

    # -- what FakeNvml asks --------------------------------------------------------------------

    def is_lost(self, gpu: int) -> bool:
        with self._lock:
            return gpu in self.lost

    def action(self, gpu: int) -> int:
        with self._lock:
            return self.recovery_action[gpu]

    def take_lost_news(self) -> bool:
        with self._lock:
            news, self._lost_news = self._lost_news, False
            return news

    def next_event(self, registered: Mapping[int, int], now: float) -> tuple[int, int, int, int, int] | None:
        """(gpu, type, data, gpu instance, compute instance) of the next due event the set registered."""
        with self._lock:
            for _ in range(len(self._streams)):
                stream = self._streams[0]
                if stream.due() > now:
                    self._streams.rotate(-1)
                    continue
                stream.sent += 1
                stream.left -= 1
                if stream.left <= 0:
                    self._streams.popleft()
                if registered.get(stream.gpu, 0) & stream.event_type:
                    return (stream.gpu, stream.event_type, stream.data, stream.gpu_instance,
                            stream.compute_instance)
            return None

    def pending(self) -> bool:
        with self._lock:
            return bool(self._streams)


def _int(record: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = record.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadInjection(f"{key!r} must be a non-negative integer, not {value!r}")
    return value
