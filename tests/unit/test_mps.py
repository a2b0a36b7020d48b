"""MPS daemons per claim, against a fake `nvidia-cuda-mps-control`, and their place in prepare.

The fake behaves like the real tool where the driver relies on it: `-d` forks a daemon
(environment kept, stdio detached) that opens `<pipe dir>/control` as a FIFO and logs
each command to `<log dir>/control.log`; without `-d` it forwards its stdin to that FIFO;
`quit` ends the daemon. `fake.json` next to it can make it fail to start or ignore `quit`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pynvml
import pytest

from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.devices import node_devices
from dra_driver.gpu import compute_mode, discover, load_profile
from dra_driver.gpu.compute_mode import ComputeModeError, ComputeModes
from dra_driver.gpu.sim.fake_nvml import FakeNvml
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.state import NodePreparer
from dra_driver.sharing.config import DEFAULT_SHM_SIZE, ConfigError, MpsConfig, parse_gpu_config
from dra_driver.sharing.mps.adoption import CLAIM_MARKER_ENV
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.mps.errors import MpsError
from dra_driver.sharing.mps.layout import check_pipe_dir_length, default_root, find_control_binary
from dra_driver.sharing.mps.settings import (
    CONTAINER_PIPE_DIR,
    MpsDevice,
    MpsSettings,
    client_env,
    control_commands,
    settings_for_claim,
)
from dra_driver.sharing.mps_launch import cgroup_targets
from dra_driver.sharing.policy import Sharing
from tests.harness.checkpoints import back_to_started
from tests.harness.fake_mps import kill_daemons, run_unique_uid, set_mode
from tests.harness.objects import wait_for
from tests.harness.simulated_preparer import preparer_factory

GI = 2**30
UID = run_unique_uid("1c9e7d3a")
POOL = "node-a"


def settings(uid: str = UID, limit: int | None = 10 * GI, pct: int | None = None) -> MpsSettings:
    return MpsSettings(uid, (MpsDevice("GPU-aaaa", limit),), pct)


# --------------------------------------------------------------------------- pure parts


def test_settings_keep_the_device_order_and_need_one_percentage() -> None:
    s = settings_for_claim(UID, [("GPU-b", MpsConfig(50, GI)), ("GPU-a", MpsConfig(50, None))])
    assert s == MpsSettings(UID, (MpsDevice("GPU-b", GI), MpsDevice("GPU-a", None)), 50)
    with pytest.raises(ConfigError, match=r"same mps\.defaultActiveThreadPercentage"):
        settings_for_claim(UID, [("GPU-b", MpsConfig(50, GI)), ("GPU-a", MpsConfig(None, GI))])


def test_client_env_and_daemon_defaults() -> None:
    s = MpsSettings(
        UID, (MpsDevice("GPU-a", 10 * GI), MpsDevice("GPU-b", None), MpsDevice("GPU-c", 10**10)), 25
    )
    assert client_env(s) == (
        f"CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10G,2=9536M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
    )
    assert control_commands(s) == (
        "set_default_active_thread_percentage 25",
        "set_default_device_pinned_mem_limit 0 10G",
        "set_default_device_pinned_mem_limit 2 9536M",
    )
    assert client_env(settings(limit=None)) == (f"CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}",)


def test_container_edits_mount_the_claims_own_dirs(tmp_path: Path) -> None:
    control = MpsControl(tmp_path / "seen", "/driver", host_root="/var/lib/plugin/mps")
    edits = control.container_edits(settings())
    assert [(m.host_path, m.container_path) for m in edits.mounts] == [
        (f"/var/lib/plugin/mps/{UID}/pipe", "/tmp/nvidia-mps"),
        (f"/var/lib/plugin/mps/{UID}/shm", "/dev/shm"),
    ]
    assert all("rw" in m.options and "bind" in m.options for m in edits.mounts)
    no_shm = MpsControl(tmp_path, "/driver", private_shm=False).container_edits(settings())
    assert [m.container_path for m in no_shm.mounts] == ["/tmp/nvidia-mps"]


def test_settings_round_trip_through_json() -> None:
    s = MpsSettings(UID, (MpsDevice("GPU-a", GI), MpsDevice("GPU-b", None)), 30)
    assert MpsSettings.from_json(json.loads(json.dumps(s.to_json()))) == s


def test_claim_uids_that_could_escape_the_directory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not usable"):
        MpsControl(tmp_path, "/driver").dirs("../etc")


# --------------------------------------------------------------------------- the daemon


def test_control_binary_is_found_under_the_driver_root(fake_bin: Path, tmp_path: Path) -> None:
    assert find_control_binary(fake_bin.parent.parent) == fake_bin
    with pytest.raises(MpsError, match=r"nvidia-cuda-mps-control not found under the driver root .*empty"):
        MpsControl(tmp_path / "m", tmp_path / "empty").control_binary()


def test_start_then_stop(mps: MpsControl) -> None:
    mps.start(settings(pct=40))
    dirs = mps.dirs(UID)
    pids = mps.daemon_pids(UID)
    assert len(pids) == 1
    assert (dirs.pipe / "control").exists()
    assert mps.saved_settings(UID) == settings(pct=40)
    env = json.loads((dirs.log / "env.json").read_text())
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(dirs.pipe)
    assert env[CLAIM_MARKER_ENV] == UID
    assert os.stat(dirs.pipe).st_mode & 0o7777 == 0o1733  # users create, only root lists
    assert os.stat(dirs.base).st_mode & 0o7777 == 0o711
    assert "ok" in mps.send(UID, "get_server_list")

    assert mps.stop(UID)
    assert not mps.daemon_pids(UID)
    assert not dirs.base.exists()
    assert not mps.stop(UID), "a second stop has nothing to do"


def test_start_sends_the_limits_as_daemon_defaults(mps: MpsControl) -> None:
    mps.start(settings(pct=40))
    control_log = mps.dirs(UID).log / "control.log"
    # the stand-in daemon logs each command as it reads it, which can be after start returns
    def logged() -> list[str] | None:
        lines = control_log.read_text().splitlines()
        return lines if len(lines) >= 3 else None

    log = wait_for("3 lines in the control log", logged, timeout=10, interval=0.02)
    assert log == [
        "started",
        "cmd set_default_active_thread_percentage 40",
        "cmd set_default_device_pinned_mem_limit 0 10G",
    ]


def test_start_is_idempotent_and_restarts_on_new_settings(mps: MpsControl) -> None:
    mps.start(settings())
    first = mps.daemon_pids(UID)
    mps.start(settings())
    assert mps.daemon_pids(UID) == first
    mps.start(settings(limit=5 * GI))
    second = mps.daemon_pids(UID)
    assert second and second != first
    assert mps.saved_settings(UID) == settings(limit=5 * GI)


def test_a_pid_file_naming_another_process_is_not_the_daemon(mps: MpsControl) -> None:
    mps.start(settings())
    pid = mps.daemon_pid(UID)
    assert pid is not None
    mps.dirs(UID).pid_file.write_text(f"{os.getpid()}\n")  # a reused PID: no claim marker
    assert mps.daemon_pid(UID) is None
    assert mps.is_running(UID), "the marker still finds the daemon"


def test_a_dead_daemon_restarts_in_the_same_directories(mps: MpsControl) -> None:
    mps.start(settings())
    dirs = mps.dirs(UID)
    inodes = {d: os.stat(d).st_ino for d in (dirs.base, dirs.pipe, dirs.shm)}
    (dirs.pipe / "client-socket").write_text("")  # what a dead daemon leaves behind
    for pid in mps.daemon_pids(UID):
        os.kill(pid, 9)
    wait_for("the daemon to die", lambda: not mps.daemon_pids(UID) or None, timeout=5, interval=0.02)
    assert not mps.is_running(UID)

    mps.start(settings())
    assert mps.is_running(UID)
    assert {d: os.stat(d).st_ino for d in inodes} == inodes
    assert not (dirs.pipe / "client-socket").exists(), "stale pipes are cleared, the directory kept"


def test_a_daemon_that_ignores_quit_is_killed(mps: MpsControl, fake_bin: Path) -> None:
    set_mode(fake_bin, ignore_quit=True)
    mps.start(settings())
    assert mps.daemon_pids(UID)
    assert mps.stop(UID)
    assert not mps.daemon_pids(UID)
    assert not mps.dirs(UID).base.exists()


def test_a_failed_start_says_why_and_leaves_nothing(mps: MpsControl, fake_bin: Path) -> None:
    set_mode(fake_bin, fail=True)
    with pytest.raises(MpsError, match=r"exit 3\): fake: cannot start"):
        mps.start(settings())
    assert not mps.dirs(UID).base.exists()


def test_a_daemon_without_control_pipe_times_out(short_root: Path, fake_bin: Path) -> None:
    set_mode(fake_bin, no_pipe=True)
    control = MpsControl(
        short_root / "mps", fake_bin.parent.parent, private_shm=False, start_timeout=0.5, stop_timeout=0.5
    )
    with pytest.raises(MpsError, match="did not open its control pipe"):
        control.start(settings())
    assert not control.daemon_pids(UID)


def test_a_pipe_directory_too_long_for_unix_sockets_is_refused(tmp_path: Path, fake_bin: Path) -> None:
    deep = tmp_path / ("d" * 60) / "mps"
    control = MpsControl(deep, fake_bin.parent.parent, private_shm=False)
    with pytest.raises(MpsError, match=r"too long for UNIX socket paths \(\d+ > 107 bytes"):
        control.start(settings())
    assert not control.daemon_pids(UID)


def test_a_root_that_other_users_cannot_search_is_refused(short_root: Path, fake_bin: Path) -> None:
    private = short_root / "private"
    private.mkdir()
    private.chmod(0o700)
    control = MpsControl(private / "mps", fake_bin.parent.parent, private_shm=False)
    with pytest.raises(MpsError, match=r"private \(mode 0700\) is not searchable by other users"):
        control.start(settings())
    assert not control.daemon_pids(UID)
    assert not control.dirs(UID).base.exists()


def test_the_default_root_is_short_enough() -> None:
    check_pipe_dir_length(default_root("gpu.dra-driver.dev") / UID / "pipe")


def _can_unshare() -> bool:
    if os.geteuid() != 0:
        return False
    probe = ["unshare", "--mount", "--propagation", "private", "true"]
    try:
        return subprocess.run(probe, capture_output=True, check=False).returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare --mount")
def test_private_shm_is_the_claims_directory(short_root: Path, fake_bin: Path) -> None:
    control = MpsControl(short_root / "mps", fake_bin.parent.parent, start_timeout=5, stop_timeout=2)
    set_mode(fake_bin, shm_marker=True)
    try:
        control.start(settings())
        marker = f"fake-mps-{UID}"
        assert (control.dirs(UID).shm / marker).exists()
        assert not Path("/dev/shm", marker).exists()
    finally:
        control.stop(UID)


@pytest.mark.skipif(not _can_unshare(), reason="needs root and mount(2)")
def test_each_claim_gets_a_tmpfs_of_its_size_for_dev_shm(short_root: Path, fake_bin: Path) -> None:
    control = MpsControl(short_root / "mps", fake_bin.parent.parent, start_timeout=5, stop_timeout=2)
    try:
        control.start(replace(settings(), shm_size=32 * 2**20))
        shm = control.dirs(UID).shm
        st = os.statvfs(shm)
        assert os.path.ismount(shm)
        assert st.f_blocks * st.f_frsize == 32 * 2**20
        assert os.stat(shm).st_mode & 0o7777 == 0o1777
    finally:
        control.stop(UID)
    assert not os.path.ismount(shm) and not shm.exists()


def test_an_shm_size_above_the_free_space_is_refused_before_anything_changes(
    short_root: Path, fake_bin: Path
) -> None:
    control = MpsControl(short_root / "mps", fake_bin.parent.parent, start_timeout=5, stop_timeout=2)
    st = os.statvfs(short_root)
    too_big = st.f_bavail * st.f_frsize + 2**30
    with pytest.raises(MpsError, match=r"mps\.shmSize .* is more than the .* free .*ask for less"):
        control.start(replace(settings(), shm_size=too_big))
    assert not control.claim_uids()
    assert not control.daemon_pids(UID)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("lots", "must be a quantity from 1Mi to 1Ti"),
        ("0", "must be a quantity from 1Mi to 1Ti"),
        (0, "must be a quantity from 1Mi to 1Ti"),
        ("-64Mi", "must be a quantity from 1Mi to 1Ti"),
        ("2Ti", "must be a quantity from 1Mi to 1Ti"),
    ],
)
def test_shm_size_must_be_a_positive_quantity(value: object, message: str) -> None:
    params = {**MPS_PARAMS, "sharing": {"strategy": "MPS", "mps": {"shmSize": value}}}
    with pytest.raises(ConfigError, match=rf"sharing\.mps\.shmSize: .*{message}"):
        parse_gpu_config(params, DRIVER)
    ok = {**MPS_PARAMS, "sharing": {"strategy": "MPS", "mps": {"shmSize": "1Gi"}}}
    assert parse_gpu_config(ok, DRIVER).sharing.mps == MpsConfig(shm_size=2**30)


def test_the_claims_shm_size_is_the_largest_asked_and_defaults_to_64mi() -> None:
    assert settings_for_claim(UID, [("GPU-a", MpsConfig())]).shm_size == DEFAULT_SHM_SIZE == 64 * 2**20
    big = settings_for_claim(UID, [("GPU-a", MpsConfig(shm_size=GI)), ("GPU-b", MpsConfig())])
    assert big.shm_size == GI
    assert MpsSettings.from_json(big.to_json()) == big


def test_the_launcher_finds_the_cgroups_of_a_process_in_every_hierarchy() -> None:
    cgroup = "9:name=systemd:/init.scope\n4:memory:/system\n1:cpu,cpuacct:/\n0::/init.scope\n"
    mountinfo = "\n".join(
        [
            "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755",
            "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct",
            "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory",
            "40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd",
            "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate",
            "50 23 0:32 /other /elsewhere rw,relatime - cgroup cgroup rw,memory",  # another subtree
        ]
    )
    assert [str(t) for t in cgroup_targets(cgroup, mountinfo)] == [
        "/sys/fs/cgroup/cpu,cpuacct/cgroup.procs",
        "/sys/fs/cgroup/memory/system/cgroup.procs",
        "/sys/fs/cgroup/systemd/init.scope/cgroup.procs",
        "/sys/fs/cgroup/unified/init.scope/cgroup.procs",
    ]


# --------------------------------------------------------------------------- in prepare


def mps_claim(parameters: Any, uid: str = UID) -> dict[str, Any]:
    return {
        "metadata": {"uid": uid, "namespace": "default", "name": "shared"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", "driver": DRIVER, "pool": POOL, "device": "gpu-0"}],
                    "config": [
                        {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": parameters}}
                    ],
                }
            }
        },
    }


MPS_PARAMS = {
    "apiVersion": f"{DRIVER}/v1alpha1",
    "kind": "GpuConfig",
    "sharing": {"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "10Gi"}},
}


@pytest.fixture
def make_preparer(tmp_path: Path, mps: MpsControl) -> Any:
    return preparer_factory(tmp_path, mps, POOL)


REF = ClaimRef("default", "shared", UID)


def prepare(preparer: NodePreparer) -> str | None:
    """Prepare REF; the plugin's error text, or None."""
    return asyncio.run(preparer.prepare([REF]))[UID].error


def spec_of(preparer: NodePreparer) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(next(preparer.steps.cdi_dir.glob("*.json")).read_text())
    return spec


def test_prepare_starts_the_daemon_and_puts_its_edits_in_the_spec(
    make_preparer: Any, mps: MpsControl
) -> None:
    preparer = make_preparer(mps_claim(MPS_PARAMS))

    asyncio.run(preparer.recover())
    assert prepare(preparer) is None
    assert mps.is_running(UID)
    edits = spec_of(preparer)["devices"][0]["containerEdits"]
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10G" in edits["env"]
    assert {
        "hostPath": str(mps.dirs(UID).pipe),
        "containerPath": "/tmp/nvidia-mps",
        "options": ["rw", "nosuid", "nodev", "bind"],
    } in edits["mounts"]
    assert preparer.read_checkpoint().claims[UID].phase == ckpt.ClaimPhase.COMPLETED

    asyncio.run(preparer.unprepare([REF]))
    assert not mps.is_running(UID)
    assert not mps.dirs(UID).base.exists()
    assert not list(preparer.steps.cdi_dir.glob("*.json"))


def test_a_claim_without_mps_starts_nothing(make_preparer: Any, mps: MpsControl) -> None:
    preparer = make_preparer(mps_claim({**MPS_PARAMS, "sharing": {"strategy": "TimeSlicing"}}))
    asyncio.run(preparer.recover())
    prepare(preparer)
    assert not mps.claim_uids()
    assert not any(e.startswith("CUDA_MPS") for e in spec_of(preparer)["devices"][0]["containerEdits"]["env"])


def test_an_invalid_config_is_refused_before_anything_is_touched(make_preparer: Any, mps: MpsControl) -> None:
    bad = {**MPS_PARAMS, "sharing": {"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "10GB"}}}
    preparer = make_preparer(mps_claim(bad))
    asyncio.run(preparer.recover())
    assert re.search(
        r"invalid configuration for driver gpu.dra-driver.dev: "
        r".*defaultPinnedDeviceMemoryLimit: must be a quantity",
        str(prepare(preparer)),
    )
    assert UID not in preparer.read_checkpoint().claims
    assert not mps.claim_uids()


def test_a_daemon_that_cannot_start_rolls_the_claim_back(
    make_preparer: Any, mps: MpsControl, fake_bin: Path
) -> None:
    set_mode(fake_bin, fail=True)
    preparer = make_preparer(mps_claim(MPS_PARAMS))
    asyncio.run(preparer.recover())
    assert "GPU sharing could not be set up on this node" in str(prepare(preparer))
    assert UID not in preparer.read_checkpoint().claims
    assert not list(preparer.steps.cdi_dir.glob("*.json"))
    assert not mps.claim_uids()


def test_recover_restarts_a_dead_daemon_and_rewrites_the_spec_with_its_edits(
    make_preparer: Any, mps: MpsControl
) -> None:
    preparer = make_preparer(mps_claim(MPS_PARAMS))
    asyncio.run(preparer.recover())
    prepare(preparer)
    # the plugin's container restarts: the daemon dies with it, the tmpfs spec is gone too
    kill_daemons(mps, UID)
    for spec in preparer.steps.cdi_dir.glob("*.json"):
        spec.unlink()
    (mps.dirs(UID).pipe / "control").unlink()

    pipe_inode = os.stat(mps.dirs(UID).pipe).st_ino

    restarted = make_preparer(mps_claim(MPS_PARAMS))
    asyncio.run(restarted.recover())
    assert mps.is_running(UID)
    assert os.stat(mps.dirs(UID).pipe).st_ino == pipe_inode, (
        "the daemon came back in the directory the claim's containers have mounted"
    )
    assert (
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10G" in spec_of(restarted)["devices"][0]["containerEdits"]["env"]
    )


def test_recover_adopts_a_live_daemon_another_plugin_started(make_preparer: Any, mps: MpsControl) -> None:
    preparer = make_preparer(mps_claim(MPS_PARAMS))
    asyncio.run(preparer.recover())
    prepare(preparer)
    pid = mps.daemon_pid(UID)
    assert pid is not None and mps.daemon_pids(UID) == (pid,)
    inode = os.stat(mps.dirs(UID).pipe).st_ino

    # a new plugin process (new MpsControl, new preparer) on the same node dirs
    again = MpsControl(mps.root, mps.driver_root, private_shm=False, start_timeout=5, stop_timeout=2)
    restarted = make_preparer(mps_claim(MPS_PARAMS))
    restarted.steps.sharing.mps = again
    asyncio.run(restarted.recover())
    assert again.daemon_pid(UID) == pid, "the same daemon, not a new one"
    assert again.daemon_pids(UID) == (pid,)
    assert os.stat(again.dirs(UID).pipe).st_ino == inode


def test_recover_stops_daemons_of_unknown_claims(make_preparer: Any, mps: MpsControl) -> None:
    orphan = run_unique_uid("0rphan00")
    mps.start(settings(uid=orphan))
    preparer = make_preparer(mps_claim(MPS_PARAMS))
    asyncio.run(preparer.recover())
    assert not mps.is_running(orphan)
    assert not mps.claim_uids()


def test_an_interrupted_prepare_is_rolled_back_with_its_daemon(make_preparer: Any, mps: MpsControl) -> None:
    preparer = make_preparer(mps_claim(MPS_PARAMS))
    asyncio.run(preparer.recover())
    prepare(preparer)
    # as if the plugin died after `started` and the daemon's start: mark the entry started again
    ckpt.save(preparer.steps.checkpoint_path, back_to_started(preparer.read_checkpoint(), UID))
    restarted = make_preparer(mps_claim(MPS_PARAMS))
    asyncio.run(restarted.recover())
    assert UID not in restarted.read_checkpoint().claims
    assert not mps.is_running(UID)


# --------------------------------------------------------------------------- compute mode


@pytest.fixture
def fake_nvml() -> FakeNvml:
    return FakeNvml(load_profile("h200-single"))


@pytest.fixture
def exclusive_mps(short_root: Path, fake_bin: Path, fake_nvml: FakeNvml) -> Iterator[MpsControl]:
    control = MpsControl(
        short_root / "mps",
        fake_bin.parent.parent,
        private_shm=False,
        compute=ComputeModes(fake_nvml),
        start_timeout=5,
        stop_timeout=2,
    )
    yield control
    set_mode(fake_bin)
    fake_nvml.compute_mode_errors.clear()
    for uid in control.claim_uids():
        control.stop(uid)


def gpu0_uuid(fake_nvml: FakeNvml) -> str:
    return fake_nvml.profile.gpus[0].uuid


def test_fake_nvml_models_compute_mode_as_nvml_does(fake_nvml: FakeNvml) -> None:
    modes = ComputeModes(fake_nvml)
    uuid = gpu0_uuid(fake_nvml)
    assert modes.get(uuid) == compute_mode.DEFAULT
    fake_nvml.open_context(0, "a")
    fake_nvml.open_context(0, "b")  # Default: any number of processes
    fake_nvml.close_context(0, "b")
    modes.set(uuid, compute_mode.EXCLUSIVE_PROCESS)
    fake_nvml.open_context(0, "a")  # the holder may open more
    with pytest.raises(pynvml.NVMLError):
        fake_nvml.open_context(0, "b")  # a second process is refused
    fake_nvml.close_context(0, "a")
    fake_nvml.open_context(0, "b")
    fake_nvml.compute_mode_errors[0] = pynvml.NVML_ERROR_NO_PERMISSION
    with pytest.raises(ComputeModeError, match=rf"setting GPU {uuid} to compute mode Default failed"):
        modes.set(uuid, compute_mode.DEFAULT)


def whole_gpu_mps_preparer(make_preparer: Any, control: MpsControl) -> NodePreparer:
    preparer: NodePreparer = make_preparer(mps_claim(MPS_PARAMS))
    preparer.steps.sharing.mps = control
    return preparer


def test_a_whole_gpu_mps_claim_gets_exclusive_process_mode_and_gives_it_back(
    make_preparer: Any, exclusive_mps: MpsControl, fake_nvml: FakeNvml
) -> None:
    fake_nvml.compute_modes[0] = compute_mode.PROHIBITED  # whatever was there is what comes back
    preparer = whole_gpu_mps_preparer(make_preparer, exclusive_mps)
    asyncio.run(preparer.recover())
    assert prepare(preparer) is None
    assert fake_nvml.compute_modes[0] == compute_mode.EXCLUSIVE_PROCESS
    assert exclusive_mps.is_running(UID)
    recorded = json.loads(exclusive_mps.dirs(UID).compute_mode_file.read_text())
    assert recorded == {gpu0_uuid(fake_nvml): compute_mode.PROHIBITED}
    fake_nvml.open_context(0, "mps-server")
    with pytest.raises(pynvml.NVMLError):
        fake_nvml.open_context(0, "a process around MPS")
    fake_nvml.close_context(0, "mps-server")

    assert asyncio.run(preparer.unprepare([REF]))[UID].error is None
    assert fake_nvml.compute_modes[0] == compute_mode.PROHIBITED
    assert not exclusive_mps.claim_uids()


def test_a_crash_between_set_and_restore_is_repaired_by_recovery(
    make_preparer: Any, exclusive_mps: MpsControl, fake_nvml: FakeNvml
) -> None:
    preparer = whole_gpu_mps_preparer(make_preparer, exclusive_mps)
    asyncio.run(preparer.recover())
    prepare(preparer)
    assert fake_nvml.compute_modes[0] == compute_mode.EXCLUSIVE_PROCESS
    # the plugin died after the mode was set, before the claim was completed
    ckpt.save(preparer.steps.checkpoint_path, back_to_started(preparer.read_checkpoint(), UID))
    restarted = whole_gpu_mps_preparer(make_preparer, exclusive_mps)
    asyncio.run(restarted.recover())
    assert UID not in restarted.read_checkpoint().claims
    assert fake_nvml.compute_modes[0] == compute_mode.DEFAULT, "the mode found before the claim"
    assert not exclusive_mps.claim_uids()


def test_a_restarted_daemon_keeps_the_mode_it_first_found(
    exclusive_mps: MpsControl, fake_nvml: FakeNvml
) -> None:
    uuid = gpu0_uuid(fake_nvml)
    exclusive_mps.start(MpsSettings(UID, (MpsDevice(uuid),), exclusive_gpus=(uuid,)))
    for pid in exclusive_mps.daemon_pids(UID):
        os.kill(pid, 9)
    wait_for("the daemon to die", lambda: not exclusive_mps.daemon_pids(UID) or None, timeout=5)
    exclusive_mps.start(MpsSettings(UID, (MpsDevice(uuid),), exclusive_gpus=(uuid,)))
    assert json.loads(exclusive_mps.dirs(UID).compute_mode_file.read_text()) == {uuid: compute_mode.DEFAULT}
    exclusive_mps.stop(UID)
    assert fake_nvml.compute_modes[0] == compute_mode.DEFAULT


def test_a_gpu_whose_mode_cannot_be_set_refuses_the_claim_and_changes_nothing(
    make_preparer: Any, exclusive_mps: MpsControl, fake_nvml: FakeNvml
) -> None:
    fake_nvml.compute_mode_errors[0] = pynvml.NVML_ERROR_NO_PERMISSION
    preparer = whole_gpu_mps_preparer(make_preparer, exclusive_mps)
    asyncio.run(preparer.recover())
    error = prepare(preparer)
    assert error is not None
    assert "to compute mode ExclusiveProcess failed" in error
    assert "--no-mps-exclusive-compute-mode" in error
    assert fake_nvml.compute_modes[0] == compute_mode.DEFAULT
    assert not exclusive_mps.claim_uids() and not exclusive_mps.daemon_pids(UID)
    assert UID not in preparer.read_checkpoint().claims


def test_shares_and_mig_never_ask_for_exclusive_mode() -> None:
    inventory = discover("h200-single")
    devices = node_devices(inventory)
    sharing = Sharing(DRIVER, POOL, MpsControl("/nonexistent", "/driver"))
    plan = sharing.plan(UID, mps_claim(MPS_PARAMS), [devices["gpu-0"]])
    assert plan is not None and plan.exclusive_gpus == (inventory.gpus[0].uuid,)
    no_mps = mps_claim({"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig"})
    assert sharing.plan(UID, no_mps, [devices["gpu-0"]]) is None


def test_inventory_says_a_share_isolates_cooperatively() -> None:
    from click.testing import CliRunner

    from dra_driver.commands.inventory import inventory

    out = CliRunner().invoke(inventory, ["--simulate", "h200-single"]).output
    assert "isolation is cooperative" in out and "steps\naround MPS gets the whole GPU" in out
    assert "MIG instances or whole GPUs" in out
    mig_only = CliRunner().invoke(inventory, ["--simulate", "a100-mig"]).output
    assert ("isolation is cooperative" in mig_only) == any(
        not g.mig_enabled for g in discover("a100-mig").gpus
    ), "the note only where a GPU can be shared"
