"""The kubelet plugin's record of what it has prepared: the source of truth across restarts.

Unprepare gets only a claim's UID, namespace and name, and the claim may already be
gone from the API server, so the plugin must remember what it prepared. Prepare writes a
claim as `started` before it touches the node (CDI spec, sharing daemons) and as
`completed` after, so a crash in between leaves a record of what may need cleaning up.
A claim's dynamic MIG instances are recorded the same way (`MigRecord`, under `mig`): the
intent (parent GPU, profile, start slice) in `started`, the instance's ids and MIG UUID in
`completed`; entries without any leave the field out, so older files read unchanged.

The file is `<state dir>/checkpoint.json` (default /run/<driver>/state: a tmpfs, because
everything it describes ends with the boot), replaced atomically (temp file, rename), with a
format version, the build that wrote it, the driver (name) and the boot id of the boot that
wrote it, and a SHA-256 of its payload so that a torn or edited file is detected rather than trusted. A
checkpoint from an earlier boot is discarded: the tmpfs CDI specs and any daemons it
describes died with that boot.

It is not fsync'd, because nothing in it outlives the boot that wrote it: a crash of the
plugin leaves the page cache, so the next reader sees exactly the last rename; a crash of
the machine ends the boot, after which the checkpoint is discarded (or, if the power loss
tore it, moved aside as unreadable; recovery then adopts no spec older than the boot).
Four fsyncs per Prepare bought nothing and cost most of its latency.

Two kinds of unreadable file are told apart, because they call for opposite actions:
`CheckpointUnreadable` (not a file, not JSON, wrong shape, wrong checksum: move it aside and
rebuild), and `CheckpointRefused` (readable, but not this plugin's to change: stop and leave
it as it is). A checkpoint is refused when a newer build wrote it (`CheckpointFromNewerVersion`:
a rollback to that build must find it intact) or another driver did
(`CheckpointOfAnotherDriver`: two releases pointed at one state dir; adopting or rewriting
the other's record would cost its pods their devices). A file from before the driver was
recorded (no `driver` field) is read as this driver's and gets the field on the next save.
A failed checksum is reported with both sums, the claim entries the file holds and where it
differs from the same payload as this build writes it (as NVIDIA's plugin logs a diff), so
that the log line that moves it aside says what was corrupted.

`Checkpoint` is immutable and its entries (`started_entry`, `completed_entry`) are made by
pure functions; only `load`, `save`, `read_boot_id`, `boot_time` and `quarantine` do I/O. This
module takes no locks: the prepare transaction (`dra_driver.plugin.state`) holds the lock
around every load-modify-save.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import structlog

from dra_driver import __version__
from dra_driver.atomic import write_file_atomic
from dra_driver.plugin.prepared import MigRecord, PreparedDevice

log = structlog.get_logger(__name__)

FORMAT_VERSION: Final = 1
WRITTEN_BY: Final = f"gpu-dra-driver {__version__}"
CHECKPOINT_FILE: Final = "checkpoint.json"
BOOT_ID_PATH: Final = Path("/proc/sys/kernel/random/boot_id")


class CheckpointUnreadable(Exception):
    """Something is at the checkpoint path but cannot be trusted: not a regular file,
    unreadable, not JSON, wrong shape or wrong checksum."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"checkpoint {path} cannot be read: {problem}")
        self.path = path
        self.problem = problem


class CheckpointRefused(Exception):
    """The checkpoint is readable but not this plugin's to change; the plugin stops and leaves it."""


class CheckpointFromNewerVersion(CheckpointRefused):
    """The checkpoint was written by a newer build in a format this build does not know."""

    def __init__(self, path: Path, version: int, written_by: str | None) -> None:
        super().__init__(
            f"checkpoint {path} has format version {version}, written by "
            f"{written_by or 'a newer dra-driver'}; this build ({WRITTEN_BY}) reads format {FORMAT_VERSION} "
            "only. Run that version (or newer) of the driver on this node; the file is left untouched so "
            "that it keeps every prepared claim"
        )
        self.path = path
        self.version = version
        self.written_by = written_by


class CheckpointOfAnotherDriver(CheckpointRefused):
    """The checkpoint was written by a plugin of another driver name."""

    def __init__(self, path: Path, written_by_driver: str, driver: str) -> None:
        super().__init__(
            f"checkpoint {path} belongs to driver {written_by_driver}, and this plugin is driver {driver}: "
            "two drivers must not share a state dir. Give each release its own (--state-dir; the chart's "
            "stateDir; both default to /run/<driver name>/state) and restart this plugin; the file is left "
            f"untouched so that the pods of {written_by_driver} keep their devices"
        )
        self.path = path
        self.written_by_driver = written_by_driver
        self.driver = driver


class ClaimPhase(enum.StrEnum):
    STARTED = "started"  # Prepare began; node state may be partly set up
    COMPLETED = "completed"  # Prepare finished; the CDI ids were returned to the kubelet


@dataclass(frozen=True)
class ClaimEntry:
    """One claim this node has prepared (or is preparing)."""

    uid: str
    namespace: str
    name: str
    phase: ClaimPhase
    devices: tuple[PreparedDevice, ...]
    updated_at: datetime  # when this entry was last written, UTC
    # dynamic MIG instances made for it: intents while `started`, with their ids once made
    mig: tuple[MigRecord, ...] = ()


@dataclass(frozen=True)
class Checkpoint:
    boot_id: str
    claims: Mapping[str, ClaimEntry] = field(default_factory=dict)  # by UID; never mutated
    driver: str | None = None  # the driver that wrote it; None: a file from before it was recorded

    @classmethod
    def empty(cls, boot_id: str, driver: str | None = None) -> Checkpoint:
        return cls(boot_id=boot_id, claims={}, driver=driver)


class LoadStatus(enum.StrEnum):
    MISSING = "missing"  # no file: a fresh node or a first start
    LOADED = "loaded"
    STALE_BOOT = "stale-boot"  # written in an earlier boot, discarded


@dataclass(frozen=True)
class LoadResult:
    checkpoint: Checkpoint
    status: LoadStatus
    discarded: Checkpoint | None = None  # the earlier boot's checkpoint, for logging/cleanup


# --------------------------------------------------------------------------- transitions


def _now(now: datetime | None) -> datetime:
    return now if now is not None else datetime.now(UTC)


def started_entry(
    namespace: str,
    name: str,
    uid: str,
    devices: Sequence[PreparedDevice],
    *,
    now: datetime | None = None,
    mig: Sequence[MigRecord] = (),
) -> ClaimEntry:
    """The entry of claim `uid` while it is being prepared with `devices` (and `mig`: the
    MIG instances it is about to create). `now` is the entry's timestamp (default: now)."""
    return ClaimEntry(
        uid=uid,
        namespace=namespace,
        name=name,
        phase=ClaimPhase.STARTED,
        devices=tuple(devices),
        updated_at=_now(now),
        mig=tuple(mig),
    )


def completed_entry(
    entry: ClaimEntry,
    *,
    now: datetime | None = None,
    devices: Sequence[PreparedDevice] | None = None,
    mig: Sequence[MigRecord] | None = None,
) -> ClaimEntry:
    """`entry` prepared; `devices` and `mig` (the instances as made) replace the recorded ones if given."""
    return replace(
        entry,
        phase=ClaimPhase.COMPLETED,
        devices=tuple(devices) if devices is not None else entry.devices,
        updated_at=_now(now),
        mig=tuple(mig) if mig is not None else entry.mig,
    )


# --------------------------------------------------------------------------- encoding


def _timestamp(t: datetime) -> str:
    if t.tzinfo is None:
        raise ValueError(f"timestamp {t!r} has no time zone")
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _device_to_dict(d: PreparedDevice) -> dict[str, Any]:
    out: dict[str, Any] = {
        "pool": d.pool,
        "device": d.device,
        "requestNames": list(d.request_names),
        "cdiDeviceIds": list(d.cdi_device_ids),
    }
    if d.share_id is not None:
        out["shareId"] = d.share_id
    if d.admin_access:
        out["adminAccess"] = True
    return out


def _mig_to_dict(m: MigRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "device": m.device,
        "parentUUID": m.parent_uuid,
        "profileId": m.profile_id,
        "start": m.start,
    }
    if m.gpu_instance_id is not None:
        out["gpuInstanceId"] = m.gpu_instance_id
    if m.compute_instance_id is not None:
        out["computeInstanceId"] = m.compute_instance_id
    if m.uuid is not None:
        out["uuid"] = m.uuid
    return out


def _entry_to_dict(c: ClaimEntry) -> dict[str, Any]:
    out = {
        "uid": c.uid,
        "namespace": c.namespace,
        "name": c.name,
        "phase": c.phase.value,
        "devices": [_device_to_dict(d) for d in c.devices],
        "updatedAt": _timestamp(c.updated_at),
    }
    if c.mig:  # absent for claims without dynamic MIG: their entries read as before
        out["mig"] = [_mig_to_dict(m) for m in c.mig]
    return out


def _payload(cp: Checkpoint) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "bootId": cp.boot_id,
        "claims": [_entry_to_dict(c) for c in sorted(cp.claims.values(), key=lambda c: c.uid)],
    }
    if cp.driver is not None:
        payload["driver"] = cp.driver
    return payload


def _canonical(payload: Any) -> str:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _checksum(payload: Any) -> str:
    return "sha256:" + hashlib.sha256(_canonical(payload).encode()).hexdigest()


def encode(cp: Checkpoint) -> bytes:
    """The file's bytes: {checksum, payload, version, writtenBy}, compact (the file is
    rewritten on every transaction and may hold thousands of claims).

    Exactly `_canonical` of that object, built from the canonical text of each part: the json
    module cannot reuse text it already made, and serializing every held claim again on every
    Prepare was most of its time with many held (benchmarks.held_claims). An entry is immutable,
    so its text is kept (`_EntryTexts`); sorted keys put the parts in this order."""
    claims = ",".join(_entry_texts.of(sorted(cp.claims.values(), key=lambda c: c.uid)))
    driver = "" if cp.driver is None else f',"driver":{_canonical(cp.driver)}'
    payload = f'{{"bootId":{_canonical(cp.boot_id)},"claims":[{claims}]{driver}}}'
    checksum = "sha256:" + hashlib.sha256(payload.encode()).hexdigest()
    return (f'{{"checksum":"{checksum}","payload":{payload},"version":{FORMAT_VERSION},'
            f'"writtenBy":{_canonical(WRITTEN_BY)}}}\n').encode()


class _EntryTexts:
    """The canonical text of each entry of the checkpoint last encoded, and only of those: what
    is kept is bounded by the claims held, not by how many came and went."""

    def __init__(self) -> None:
        self._texts: dict[ClaimEntry, str] = {}

    def of(self, entries: Sequence[ClaimEntry]) -> list[str]:
        known = self._texts
        texts = {e: known.get(e) or _canonical(_entry_to_dict(e)) for e in entries}
        self._texts = texts  # replaced whole: a concurrent encode at worst serializes again
        return list(texts.values())


_entry_texts = _EntryTexts()


class _Shape(Exception):
    """A field of the payload is missing or has the wrong type; the message names it."""


def _field(obj: Any, key: str, kind: type, where: str) -> Any:
    if not isinstance(obj, dict):
        raise _Shape(f"{where}: expected an object")
    if key not in obj:
        raise _Shape(f"{where}.{key}: missing")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _Shape(f"{where}.{key}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _optional(obj: Any, key: str, kind: type, where: str) -> Any:
    if isinstance(obj, dict) and obj.get(key) is None:
        return None
    return _field(obj, key, kind, where)


def _strings(obj: Any, key: str, where: str) -> tuple[str, ...]:
    values = _field(obj, key, list, where)
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise _Shape(f"{where}.{key}[{i}]: expected str")
    return tuple(values)


def _decode_payload(payload: Any) -> Checkpoint:
    boot_id = _field(payload, "bootId", str, "payload")
    driver = _optional(payload, "driver", str, "payload")
    claims: dict[str, ClaimEntry] = {}
    for i, c in enumerate(_field(payload, "claims", list, "payload")):
        where = f"payload.claims[{i}]"
        uid = _field(c, "uid", str, where)
        if uid in claims:
            raise _Shape(f"{where}.uid: {uid} appears twice")
        phase = _field(c, "phase", str, where)
        try:
            claim_phase = ClaimPhase(phase)
        except ValueError:
            raise _Shape(f"{where}.phase: unknown phase {phase!r}") from None
        devices: list[PreparedDevice] = []
        for j, d in enumerate(_field(c, "devices", list, where)):
            dw = f"{where}.devices[{j}]"
            share = _optional(d, "shareId", str, dw)
            admin = _optional(d, "adminAccess", bool, dw)
            devices.append(
                PreparedDevice(
                    pool=_field(d, "pool", str, dw),
                    device=_field(d, "device", str, dw),
                    request_names=_strings(d, "requestNames", dw),
                    cdi_device_ids=_strings(d, "cdiDeviceIds", dw),
                    share_id=share,
                    admin_access=bool(admin),
                )
            )
        stamp = _field(c, "updatedAt", str, where)
        try:
            updated = datetime.fromisoformat(stamp)
        except ValueError:
            raise _Shape(f"{where}.updatedAt: {stamp!r} is not a timestamp") from None
        if updated.tzinfo is None:
            raise _Shape(f"{where}.updatedAt: {stamp!r} has no time zone")
        mig: list[MigRecord] = []
        for j, m in enumerate(_optional(c, "mig", list, where) or ()):
            mw = f"{where}.mig[{j}]"
            mig.append(
                MigRecord(
                    device=_field(m, "device", str, mw),
                    parent_uuid=_field(m, "parentUUID", str, mw),
                    profile_id=_field(m, "profileId", int, mw),
                    start=_field(m, "start", int, mw),
                    gpu_instance_id=_optional(m, "gpuInstanceId", int, mw),
                    compute_instance_id=_optional(m, "computeInstanceId", int, mw),
                    uuid=_optional(m, "uuid", str, mw),
                )
            )
        claims[uid] = ClaimEntry(
            uid=uid,
            namespace=_field(c, "namespace", str, where),
            name=_field(c, "name", str, where),
            phase=claim_phase,
            devices=tuple(devices),
            updated_at=updated,
            mig=tuple(mig),
        )
    return Checkpoint(boot_id=boot_id, claims=claims, driver=driver)


# how many claim entries, and differences, a checksum report names before "and N more"
REPORT_ITEMS: Final = 10
_SHA256: Final = re.compile(r"sha256:[0-9a-f]{64}")


def _capped(items: Sequence[str]) -> str:
    shown = ", ".join(items[:REPORT_ITEMS])
    return shown + (f" and {len(items) - REPORT_ITEMS} more" if len(items) > REPORT_ITEMS else "")


def _differences(on_disk: Any, ours: Any, where: str) -> list[str]:
    """Where `on_disk` and `ours` (the same payload as this build writes it) differ."""
    if isinstance(on_disk, dict) and isinstance(ours, dict):
        out = [f"{where}.{k} (only in the file)" for k in sorted(set(on_disk) - set(ours))]
        out += [f"{where}.{k} (missing from the file)" for k in sorted(set(ours) - set(on_disk))]
        for k in sorted(set(on_disk) & set(ours)):
            out += _differences(on_disk[k], ours[k], f"{where}.{k}")
        return out
    if isinstance(on_disk, list) and isinstance(ours, list) and len(on_disk) == len(ours):
        return [d for i, (a, b) in enumerate(zip(on_disk, ours, strict=True))
                for d in _differences(a, b, f"{where}[{i}]")]
    if on_disk != ours or type(on_disk) is not type(ours):
        return [f"{where} ({_canonical(on_disk)[:80]} in the file, {_canonical(ours)[:80]} as written)"]
    return []


def _entries_named(payload: Any) -> list[str]:
    """The claim entries that can still be made out in a payload that does not decode."""
    claims = payload.get("claims") if isinstance(payload, dict) else None
    out: list[str] = []
    for c in claims if isinstance(claims, list) else ():
        if isinstance(c, dict):
            names = [c.get(k) for k in ("namespace", "name", "uid")]
            out.append("/".join(n if isinstance(n, str) else "?" for n in names[:2])
                       + f" (uid {names[2] if isinstance(names[2], str) else '?'})")
    return out


def _mismatch_report(payload: Any, recorded: str) -> str:
    """What a person needs to see what was corrupted, for a payload that fails its checksum:
    the claim entries in it, and (as NVIDIA's plugin logs a diff against its re-marshalled
    checkpoint) where it differs from the same payload as this build writes it. A value
    changed in place re-encodes unchanged: the checksum cannot say which one it was."""
    try:
        cp = _decode_payload(payload)
    except _Shape as e:
        named = _entries_named(payload)
        return (f"the payload does not read either ({e}); the claim entries still named in it: "
                f"{_capped(named) if named else 'none'}")
    entries = [
        f"{c.namespace}/{c.name} (uid {c.uid}, {c.phase.value}, devices "
        f"{','.join(d.device for d in c.devices) or 'none'})"
        for c in sorted(cp.claims.values(), key=lambda c: c.uid)
    ]
    report = (f"the payload still reads (boot {cp.boot_id}): {len(entries)} claim entries"
              + (f": {_capped(entries)}" if entries else ""))
    ours = _payload(cp)
    differences = _differences(payload, ours, "payload")
    if not differences:
        if not _SHA256.fullmatch(recorded):
            return report + "; it re-encodes unchanged; the recorded checksum, no SHA-256, was edited"
        return report + ("; it re-encodes unchanged, so a value in it (or the checksum itself) was "
                         "edited in place, and the checksum cannot say which")
    matches = "; written that way it matches the recorded checksum" if _checksum(ours) == recorded else ""
    return report + f"; it differs from what this build writes at {_capped(differences)}{matches}"


def decode(data: bytes, path: Path) -> Checkpoint:
    """Parse and verify a checkpoint file's bytes; the exception names what is wrong."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointUnreadable(path, f"not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise CheckpointUnreadable(path, "top level is not a JSON object")
    version = doc.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        written_by = doc.get("writtenBy")
        raise CheckpointFromNewerVersion(path, version, written_by if isinstance(written_by, str) else None)
    if type(version) is not int or version != FORMAT_VERSION:  # `true == 1` in Python
        raise CheckpointUnreadable(
            path, f"format version {version!r} is not supported (this build reads {FORMAT_VERSION})"
        )
    if "payload" not in doc or not isinstance(doc.get("checksum"), str):
        raise CheckpointUnreadable(path, "missing payload or checksum")
    actual = _checksum(doc["payload"])
    if actual != doc["checksum"]:
        raise CheckpointUnreadable(
            path,
            f"checksum mismatch (file says {doc['checksum']}, content is {actual}); "
            + _mismatch_report(doc["payload"], doc["checksum"]),
        )
    try:
        return _decode_payload(doc["payload"])
    except _Shape as e:
        raise CheckpointUnreadable(path, f"unexpected shape: {e}") from e


# --------------------------------------------------------------------------- I/O


def checkpoint_path(state_dir: Path) -> Path:
    return Path(state_dir) / CHECKPOINT_FILE


def read_boot_id(path: Path = BOOT_ID_PATH) -> str:
    """This boot's id; it changes on every reboot."""
    boot_id = path.read_text(encoding="ascii").strip()
    if not boot_id:
        raise ValueError(f"{path} is empty")
    return boot_id


def boot_time(stat_path: Path = Path("/proc/stat")) -> float:
    """When this boot started, in seconds since the epoch (`btime`); files older than it
    were written in an earlier boot."""
    for line in stat_path.read_text(encoding="ascii").splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise ValueError(f"{stat_path} has no btime line")


def load(path: Path, boot_id: str, driver: str | None = None) -> LoadResult:
    """The checkpoint at `path` for this boot, of `driver` (None: whichever wrote it).

    Missing file: empty. Written in another boot: empty, status STALE_BOOT, the old one
    in `discarded`. Anything at the path that cannot be trusted: CheckpointUnreadable (see
    `quarantine`); written by a newer build: CheckpointFromNewerVersion; by another driver,
    in this boot or an earlier one: CheckpointOfAnotherDriver."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return LoadResult(checkpoint=Checkpoint.empty(boot_id, driver), status=LoadStatus.MISSING)
    except OSError as e:  # a directory, a dangling mount, no permission...
        raise CheckpointUnreadable(path, f"{e.strerror or e} ({type(e).__name__})") from e
    cp = _last.recall(path, data)
    if cp is None:
        cp = decode(data, path)
        _last.keep(path, data, cp)
    if driver is not None and cp.driver is not None and cp.driver != driver:
        raise CheckpointOfAnotherDriver(path, cp.driver, driver)
    if driver is not None and cp.driver is None:
        cp = replace(cp, driver=driver)  # from before the field: the next save records it
    if cp.boot_id != boot_id:
        log.warning(
            "checkpoint is from an earlier boot, discarding it",
            path=str(path),
            checkpoint_boot_id=cp.boot_id,
            boot_id=boot_id,
            claims=sorted(cp.claims),
        )
        return LoadResult(
            checkpoint=Checkpoint.empty(boot_id, driver), status=LoadStatus.STALE_BOOT, discarded=cp
        )
    return LoadResult(checkpoint=cp, status=LoadStatus.LOADED)


def save(path: Path, cp: Checkpoint) -> None:
    """Replace the file with `cp` atomically: a reader, or this process after a crash, finds
    the old checkpoint or the new one (not fsync'd: see the module docstring)."""
    data = encode(cp)
    write_file_atomic(path, data, mode=0o600, durable=False)
    _last.keep(path, data, cp)


class _LastCheckpoint:
    """The checkpoint this process last wrote or read, with the file's bytes: a file that
    still holds exactly those bytes is that checkpoint, so it is not decoded and verified
    again. Decoding it was most of a Prepare's time with many claims held
    (benchmarks.held_claims). Another writer (a second instance in a rolling
    update) changes the bytes, and then the file is decoded as always. One tuple, replaced
    whole: threads (Prepare runs in one) read a consistent pair without a lock."""

    def __init__(self) -> None:
        self._kept: tuple[Path, bytes, Checkpoint] | None = None

    def keep(self, path: Path, data: bytes, cp: Checkpoint) -> None:
        self._kept = (path, data, cp)

    def recall(self, path: Path, data: bytes) -> Checkpoint | None:
        kept = self._kept
        if kept is None or kept[0] != path or kept[1] != data:
            return None
        return kept[2]


_last = _LastCheckpoint()


def quarantine(path: Path, now: datetime | None = None) -> Path:
    """Move an unreadable checkpoint (file or whatever else is there) aside to
    `<name>.corrupt-<UTC timestamp>`, for a person to look at; returns the new path."""
    stamp = (now or datetime.now(UTC)).astimezone(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    os.replace(path, target)
    log.error("unreadable checkpoint moved aside", path=str(path), moved_to=str(target))
    return target
