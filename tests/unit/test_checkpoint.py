"""The plugin's checkpoint: entries, round trips, corruption, the boot-id rule,
atomic replacement."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.prepared import PreparedDevice
from tests.harness.checkpoints import with_completed, with_started, without

BOOT = "6f1e2d3c-4b5a-4968-8776-655443322110"
OTHER_BOOT = "00000000-1111-2222-3333-444444444444"
T0 = datetime(2026, 12, 2, 15, 0, 0, tzinfo=UTC)
T1 = T0 + timedelta(seconds=3)
UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"


def record(device: str = "gpu-0", share_id: str | None = None, admin: bool = False) -> PreparedDevice:
    return PreparedDevice(
        pool="node-1",
        device=device,
        request_names=("gpu",),
        cdi_device_ids=(f"gpu.dra-driver.dev/gpu={UID_A}-{device}",),
        share_id=share_id,
        admin_access=admin,
    )


def sample() -> ckpt.Checkpoint:
    cp = ckpt.Checkpoint.empty(BOOT)
    cp = with_started(
        cp, "team-a", "train", UID_A, [record("gpu-0"), record("gpu-1", share_id="s-1")], now=T0
    )
    cp = with_completed(cp, UID_A, now=T1)
    return with_started(cp, "team-b", "infer", UID_B, [record("gpu-2", admin=True)], now=T1)


# --------------------------------------------------------------------------- transitions


def test_started_then_completed() -> None:
    cp = with_started(ckpt.Checkpoint.empty(BOOT), "ns", "c", UID_A, [record()], now=T0)
    entry = cp.claims[UID_A]
    assert (entry.namespace, entry.name, entry.phase, entry.updated_at) == (
        "ns",
        "c",
        ckpt.ClaimPhase.STARTED,
        T0,
    )
    done = with_completed(cp, UID_A, now=T1)
    assert done.claims[UID_A].phase == ckpt.ClaimPhase.COMPLETED
    assert done.claims[UID_A].devices == (record(),)
    assert done.claims[UID_A].updated_at == T1
    assert cp.claims[UID_A].phase == ckpt.ClaimPhase.STARTED  # the old value is untouched


def test_completed_may_replace_the_devices() -> None:
    cp = with_started(ckpt.Checkpoint.empty(BOOT), "ns", "c", UID_A, [record("gpu-0")], now=T0)
    done = with_completed(cp, UID_A, now=T1, devices=[record("gpu-3")])
    assert [d.device for d in done.claims[UID_A].devices] == ["gpu-3"]


def test_started_again_replaces_the_entry() -> None:
    cp = sample()
    again = with_started(cp, "team-a", "train", UID_A, [record("gpu-5")], now=T1)
    assert again.claims[UID_A].phase == ckpt.ClaimPhase.STARTED
    assert [d.device for d in again.claims[UID_A].devices] == ["gpu-5"]
    assert set(again.claims) == {UID_A, UID_B}


def test_default_timestamp_is_now_in_utc() -> None:
    before = datetime.now(UTC)
    cp = with_started(ckpt.Checkpoint.empty(BOOT), "ns", "c", UID_A, [])
    assert before <= cp.claims[UID_A].updated_at <= datetime.now(UTC)


# --------------------------------------------------------------------------- round trip


def test_save_then_load_round_trips(tmp_path: Path) -> None:
    path = ckpt.checkpoint_path(tmp_path)
    ckpt.save(path, sample())
    result = ckpt.load(path, BOOT)
    assert result.status == ckpt.LoadStatus.LOADED
    assert result.checkpoint == sample()
    assert result.discarded is None
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == ["checkpoint.json"]


def test_timestamps_in_other_zones_are_stored_as_utc(tmp_path: Path) -> None:
    cest = datetime(2026, 12, 2, 17, 0, 0, tzinfo=timezone(timedelta(hours=2)))
    cp = with_started(ckpt.Checkpoint.empty(BOOT), "ns", "c", UID_A, [], now=cest)
    ckpt.save(tmp_path / "cp.json", cp)
    stored = json.loads((tmp_path / "cp.json").read_text())["payload"]["claims"][0]["updatedAt"]
    assert stored == "2026-12-02T15:00:00Z"
    assert ckpt.load(tmp_path / "cp.json", BOOT).checkpoint.claims[UID_A].updated_at == cest


def test_naive_timestamps_are_refused() -> None:
    cp = with_started(ckpt.Checkpoint.empty(BOOT), "ns", "c", UID_A, [], now=datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="time zone"):
        ckpt.encode(cp)


def test_file_layout(tmp_path: Path) -> None:
    ckpt.save(tmp_path / "cp.json", sample())
    doc = json.loads((tmp_path / "cp.json").read_text())
    assert doc["version"] == ckpt.FORMAT_VERSION
    assert doc["checksum"].startswith("sha256:")
    assert doc["payload"]["bootId"] == BOOT
    a = next(c for c in doc["payload"]["claims"] if c["uid"] == UID_A)
    assert a["phase"] == "completed"
    assert a["devices"][1] == {
        "pool": "node-1",
        "device": "gpu-1",
        "requestNames": ["gpu"],
        "cdiDeviceIds": [f"gpu.dra-driver.dev/gpu={UID_A}-gpu-1"],
        "shareId": "s-1",
    }


def test_missing_file_is_an_empty_checkpoint(tmp_path: Path) -> None:
    result = ckpt.load(tmp_path / "checkpoint.json", BOOT)
    assert result.status == ckpt.LoadStatus.MISSING
    assert result.checkpoint == ckpt.Checkpoint.empty(BOOT)


# --------------------------------------------------------------------------- boot id


def test_checkpoint_of_an_earlier_boot_is_discarded_and_reported(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    ckpt.save(path, sample())
    result = ckpt.load(path, OTHER_BOOT)
    assert result.status == ckpt.LoadStatus.STALE_BOOT
    assert result.checkpoint == ckpt.Checkpoint.empty(OTHER_BOOT)
    assert result.discarded == sample()


def test_read_boot_id(tmp_path: Path) -> None:
    (tmp_path / "boot_id").write_text(BOOT + "\n")
    assert ckpt.read_boot_id(tmp_path / "boot_id") == BOOT
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        ckpt.read_boot_id(tmp_path / "empty")


def test_read_boot_id_of_this_host() -> None:
    if not ckpt.BOOT_ID_PATH.exists():
        pytest.skip("no /proc/sys/kernel/random/boot_id here")
    assert ckpt.read_boot_id() == ckpt.read_boot_id()


# --------------------------------------------------------------------------- corruption


def corrupt(tmp_path: Path, data: bytes) -> ckpt.CheckpointUnreadable:
    path = tmp_path / "checkpoint.json"
    path.write_bytes(data)
    with pytest.raises(ckpt.CheckpointUnreadable) as info:
        ckpt.load(path, BOOT)
    assert info.value.path == path
    assert str(path) in str(info.value)
    return info.value


def valid_bytes() -> bytes:
    return ckpt.encode(sample())


def resealed(doc: dict[str, object]) -> bytes:
    """`doc` with a checksum that matches its (edited) payload: a bad shape, not a bad sum."""
    doc["checksum"] = ckpt._checksum(doc["payload"])
    return json.dumps(doc).encode()


def test_torn_file_is_corrupt(tmp_path: Path) -> None:
    data = valid_bytes()
    err = corrupt(tmp_path, data[: len(data) // 2])
    assert "not valid JSON" in err.problem


@pytest.mark.parametrize("garbage", [b"", b"\x00\x00\x00\x00", b"\xff\xfe garbage", b"[1, 2]", b"null"])
def test_garbage_is_corrupt(tmp_path: Path, garbage: bytes) -> None:
    corrupt(tmp_path, garbage)


def test_edited_payload_fails_the_checksum(tmp_path: Path) -> None:
    doc = json.loads(valid_bytes())
    doc["payload"]["claims"][0]["devices"][0]["device"] = "gpu-7"
    err = corrupt(tmp_path, json.dumps(doc).encode())
    assert "checksum mismatch" in err.problem


def test_a_failed_checksum_names_both_sums_and_the_claims_in_the_file(tmp_path: Path) -> None:
    """What an operator reads in the log line: the recorded and the computed checksum, and
    the claim entries the file holds (the edited device among them)."""
    doc = json.loads(valid_bytes())
    recorded = doc["checksum"]
    doc["payload"]["claims"][0]["devices"][0]["device"] = "gpu-7"
    problem = corrupt(tmp_path, json.dumps(doc).encode()).problem
    assert f"file says {recorded}, content is {ckpt._checksum(doc['payload'])}" in problem
    assert f"team-a/train (uid {UID_A}, completed, devices gpu-7,gpu-1)" in problem
    assert f"team-b/infer (uid {UID_B}, started, devices gpu-2)" in problem
    assert "re-encodes unchanged, so a value in it (or the checksum itself) was edited in place" in problem


def test_a_failed_checksum_names_where_the_file_differs_from_what_this_build_writes(tmp_path: Path) -> None:
    """As NVIDIA's plugin logs a diff against its re-marshalled checkpoint: a field added by
    hand (or by a build that writes more) is named, and the rest matches the sum."""
    doc = json.loads(valid_bytes())
    doc["payload"]["claims"][1]["devices"][0]["note"] = "edited"
    problem = corrupt(tmp_path, json.dumps(doc).encode()).problem
    where = "payload.claims[1].devices[0].note"
    assert f"differs from what this build writes at {where} (only in the file)" in problem
    assert problem.endswith("written that way it matches the recorded checksum")


def test_a_failed_checksum_on_a_payload_that_no_longer_reads_names_the_entries_left(tmp_path: Path) -> None:
    doc = json.loads(valid_bytes())
    doc["payload"]["claims"][1]["phase"] = "halfway"
    problem = corrupt(tmp_path, json.dumps(doc).encode()).problem
    assert "the payload does not read either (payload.claims[1].phase: unknown phase 'halfway')" in problem
    assert f"still named in it: team-a/train (uid {UID_A}), team-b/infer (uid {UID_B})" in problem


def test_a_failed_checksum_report_is_bounded(tmp_path: Path) -> None:
    cp = ckpt.Checkpoint.empty(BOOT)
    for i in range(ckpt.REPORT_ITEMS + 5):
        cp = with_started(cp, "ns", f"c{i:02}", f"uid-{i:02}", [record()], now=T0)
    doc = json.loads(ckpt.encode(cp))
    doc["checksum"] = "sha256:0"
    problem = corrupt(tmp_path, json.dumps(doc).encode()).problem
    assert f"{ckpt.REPORT_ITEMS + 5} claim entries" in problem and "and 5 more" in problem
    assert "c09 (uid uid-09" in problem and "uid-10" not in problem
    assert problem.endswith("the recorded checksum, no SHA-256, was edited")


def test_a_single_flipped_byte_is_detected(tmp_path: Path) -> None:
    data = bytearray(valid_bytes())
    i = data.index(b"gpu-1")
    data[i + 4] = ord("2")
    assert "checksum" in corrupt(tmp_path, bytes(data)).problem


def test_a_newer_format_is_not_taken_for_corruption(tmp_path: Path) -> None:
    doc = json.loads(valid_bytes())
    doc["version"] = ckpt.FORMAT_VERSION + 1
    doc["writtenBy"] = "gpu-dra-driver 9.9.9"
    path = tmp_path / "checkpoint.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ckpt.CheckpointFromNewerVersion) as info:
        ckpt.load(path, BOOT)
    assert "gpu-dra-driver 9.9.9" in str(info.value) and f"format version {ckpt.FORMAT_VERSION + 1}" in str(
        info.value
    )
    assert info.value.written_by == "gpu-dra-driver 9.9.9"


@pytest.mark.parametrize("version", [0, "1", None, True])
def test_an_unknown_older_or_odd_format_version_is_unreadable(tmp_path: Path, version: object) -> None:
    doc = json.loads(valid_bytes())
    doc["version"] = version
    assert "format version" in corrupt(tmp_path, json.dumps(doc).encode()).problem


def test_a_directory_in_place_of_the_file_is_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.mkdir()
    with pytest.raises(ckpt.CheckpointUnreadable, match="IsADirectoryError"):
        ckpt.load(path, BOOT)
    moved = ckpt.quarantine(path)
    assert moved.is_dir() and not path.exists()


def test_the_file_names_the_build_that_wrote_it(tmp_path: Path) -> None:
    ckpt.save(tmp_path / "cp.json", sample())
    assert json.loads((tmp_path / "cp.json").read_text())["writtenBy"] == ckpt.WRITTEN_BY


def test_missing_checksum(tmp_path: Path) -> None:
    doc = json.loads(valid_bytes())
    del doc["checksum"]
    assert "checksum" in corrupt(tmp_path, json.dumps(doc).encode()).problem


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda p: p.pop("bootId"), "payload.bootId: missing"),
        (lambda p: p.__setitem__("claims", {}), "payload.claims: expected list"),
        (lambda p: p["claims"][0].__setitem__("phase", "halfway"), "unknown phase 'halfway'"),
        (lambda p: p["claims"][0]["devices"][0].__setitem__("pool", 7), "devices[0].pool: expected str"),
        (lambda p: p["claims"][0]["devices"][0].__setitem__("requestNames", ["a", 1]), "requestNames[1]"),
        (
            lambda p: p["claims"][1]["devices"][0].__setitem__("adminAccess", "yes"),
            "adminAccess: expected bool",
        ),
        (lambda p: p["claims"][0].__setitem__("updatedAt", "yesterday"), "not a timestamp"),
        (lambda p: p["claims"][0].__setitem__("updatedAt", "2026-12-02T15:00:00"), "no time zone"),
        (lambda p: p["claims"].append(dict(p["claims"][0])), "appears twice"),
        (lambda p: p["claims"].__setitem__(0, "claim"), "claims[0]: expected an object"),
    ],
)
def test_wrong_shape_names_the_field(tmp_path: Path, edit: object, where: str) -> None:
    doc = json.loads(valid_bytes())
    edit(doc["payload"])  # type: ignore[operator]
    err = corrupt(tmp_path, resealed(doc))
    assert "unexpected shape" in err.problem
    assert where in err.problem


def test_quarantine_moves_the_file_aside(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_bytes(b"{torn")
    moved = ckpt.quarantine(path, now=T0)
    assert moved.name == "checkpoint.json.corrupt-20261202T150000.000000Z"
    assert moved.read_bytes() == b"{torn"
    assert not path.exists()
    assert ckpt.load(path, BOOT).status == ckpt.LoadStatus.MISSING
    path.write_bytes(b"again")
    second = ckpt.quarantine(path, now=T0)
    assert second != moved and second.read_bytes() == b"again" and moved.read_bytes() == b"{torn"


# --------------------------------------------------------------------------- atomic write


def test_crash_before_rename_leaves_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.json"
    old = sample()
    ckpt.save(path, old)
    new = without(old, UID_A)

    def crash(*_: object) -> None:
        raise OSError("simulated crash: rename did not happen")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        ckpt.save(path, new)
    monkeypatch.undo()
    assert ckpt.load(path, BOOT).checkpoint == old
    assert os.listdir(tmp_path) == ["checkpoint.json"]
    ckpt.save(path, new)
    assert ckpt.load(path, BOOT).checkpoint == new


def test_crash_during_write_leaves_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.json"
    ckpt.save(path, sample())
    real_write = os.write

    def torn_write(fd: int, data: object) -> int:
        real_write(fd, bytes(data)[:10])  # type: ignore[call-overload]
        raise OSError("simulated crash: disk full")

    monkeypatch.setattr(os, "write", torn_write)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save(path, ckpt.Checkpoint.empty(BOOT))
    monkeypatch.undo()
    assert ckpt.load(path, BOOT).checkpoint == sample()
    assert os.listdir(tmp_path) == ["checkpoint.json"]


def test_first_save_creates_the_data_dir(tmp_path: Path) -> None:
    path = ckpt.checkpoint_path(tmp_path / "plugins" / "gpu.dra-driver.dev")
    ckpt.save(path, sample())
    assert ckpt.load(path, BOOT).status == ckpt.LoadStatus.LOADED


# --------------------------------------------------------------------------- the driver


def test_the_checkpoint_records_its_driver(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    ckpt.save(path, ckpt.Checkpoint(BOOT, sample().claims, "gpu.dra-driver.dev"))
    assert json.loads(path.read_text())["payload"]["driver"] == "gpu.dra-driver.dev"
    assert ckpt.load(path, BOOT, "gpu.dra-driver.dev").checkpoint.driver == "gpu.dra-driver.dev"


@pytest.mark.parametrize("boot", [BOOT, OTHER_BOOT])
def test_another_drivers_checkpoint_is_refused_naming_both_and_left_alone(tmp_path: Path, boot: str) -> None:
    """Refused whether it is of this boot or an earlier one: an earlier boot's would otherwise be
    discarded, which is a write."""
    path = tmp_path / "checkpoint.json"
    ckpt.save(path, ckpt.Checkpoint(BOOT, sample().claims, "gpu.a.example.com"))
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    with pytest.raises(ckpt.CheckpointOfAnotherDriver) as info:
        ckpt.load(path, boot, "gpu.b.example.com")
    assert "gpu.a.example.com" in str(info.value) and "gpu.b.example.com" in str(info.value)
    assert isinstance(info.value, ckpt.CheckpointRefused)
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before


def test_a_checkpoint_from_before_the_driver_was_recorded_is_read_as_ours(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    ckpt.save(path, sample())  # no driver: the format this build's predecessors wrote
    assert "driver" not in json.loads(path.read_text())["payload"]
    loaded = ckpt.load(path, BOOT, "gpu.dra-driver.dev").checkpoint
    assert loaded.driver == "gpu.dra-driver.dev" and loaded.claims == sample().claims
    assert ckpt.load(path, BOOT).checkpoint.driver is None, "read without a driver: as written"


# --------------------------------------------------------------------------- cost with many claims held


def test_the_file_is_exactly_the_canonical_json_of_the_document(tmp_path: Path) -> None:
    """encode builds the file from each part's canonical text: it must be byte for byte what
    one canonical dump of the whole document gives, or a checksum would not verify."""
    mig = ckpt.MigRecord("gpu-0-mig-1g", "GPU-parent", 19, 0, gpu_instance_id=7, compute_instance_id=0,
                         uuid="MIG-x")
    cp = with_started(sample(), "ñs-ü", "c\"quoted", "cccccccc-0000-4000-8000-000000000003",
                      [record("gpu-3")], now=T1)
    cp = ckpt.Checkpoint(cp.boot_id, {**cp.claims, UID_A: replace(cp.claims[UID_A], mig=(mig,))}, "d.example")
    for checkpoint in (cp, ckpt.Checkpoint.empty(BOOT), ckpt.Checkpoint.empty(BOOT, "d.example")):
        payload = ckpt._payload(checkpoint)
        document = {"checksum": ckpt._checksum(payload), "payload": payload, "version": ckpt.FORMAT_VERSION,
                    "writtenBy": ckpt.WRITTEN_BY}
        assert ckpt.encode(checkpoint) == (ckpt._canonical(document) + "\n").encode()
        assert ckpt.decode(ckpt.encode(checkpoint), tmp_path) == checkpoint


def test_a_file_another_writer_changed_is_read_anew(tmp_path: Path) -> None:
    """The checkpoint kept from this process's last save stands only while the file holds the
    bytes it wrote: another instance's write, or an edit, is decoded (and verified) again."""
    path = ckpt.checkpoint_path(tmp_path)
    ckpt.save(path, sample())
    other = without(sample(), UID_B)
    path.write_bytes(ckpt.encode(other))  # as a second instance would write it
    assert ckpt.load(path, BOOT).checkpoint == other
    ckpt.save(path, sample())
    path.write_bytes(path.read_bytes().replace(b"team-a", b"team-x"))
    with pytest.raises(ckpt.CheckpointUnreadable, match="checksum mismatch"):
        ckpt.load(path, BOOT)


def test_saving_with_many_claims_held_serializes_only_what_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prepare with 500 claims held: the checkpoint it just wrote is not decoded again, and the
    held claims' entries are not serialized again (each was 10 ms at 500 claims held)."""
    path = ckpt.checkpoint_path(tmp_path)
    cp = ckpt.Checkpoint.empty(BOOT)
    for i in range(500):
        cp = with_started(cp, "ns", f"c{i}", f"{i:08d}-0000-4000-8000-000000000000", [record()], now=T0)
    ckpt.save(path, cp)
    decoded: list[int] = []
    monkeypatch.setattr(ckpt, "_decode_payload", lambda payload: decoded.append(1) or None)
    serialized: list[str] = []
    entry_to_dict = ckpt._entry_to_dict
    monkeypatch.setattr(ckpt, "_entry_to_dict", lambda c: serialized.append(c.uid) or entry_to_dict(c))
    for i in range(3):  # one more claim: load, started, save, load, completed, save
        uid = f"new{i:05d}-0000-4000-8000-000000000000"
        loaded = ckpt.load(path, BOOT).checkpoint
        ckpt.save(path, with_started(loaded, "ns", "new", uid, [record()], now=T1))
        ckpt.save(path, with_completed(ckpt.load(path, BOOT).checkpoint, uid, now=T1))
        assert serialized == [uid, uid], "only the new claim's two entries"
        serialized.clear()
    assert decoded == []
