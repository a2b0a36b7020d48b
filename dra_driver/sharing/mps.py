"""CUDA MPS (Multi-Process Service) control daemons, one per claim that asks for MPS sharing.

A claim whose configuration says `sharing.strategy: MPS` (see `dra_driver.sharing.config`) gets
its own `nvidia-cuda-mps-control -d`, started by the kubelet plugin during Prepare from
the driver root's tools, with everything private to the claim under
`<root>/<claim uid>/`:

    pipe/   CUDA_MPS_PIPE_DIRECTORY: the daemon's and servers' named pipes and sockets;
            mounted into the claim's containers at `CONTAINER_PIPE_DIR`
    log/    CUDA_MPS_LOG_DIRECTORY: control.log, server.log
    shm/    the daemon's /dev/shm (MPS clients and servers share memory through it); the
            daemon runs in its own mount namespace with this directory over /dev/shm, and
            the containers get it as their /dev/shm, so a claim never sees the host's
            /dev/shm nor another claim's (the NVIDIA device plugin does the same with a tmpfs)
    settings.json   what the daemon was started with, so a restarted plugin can restart a
            daemon that died, rebuild the CDI edits, and stop daemons it no longer knows

Two facts of MPS, both seen on the H200 host, constrain `<root>` (default
`/run/<driver>/mps`, see `default_root`): the daemon binds UNIX sockets in the pipe
directory, so its path must stay short (a 101-character one made the daemon exit 1
silently); and it starts each client's server as that client's user, so every directory
above the pipe and log directories must be searchable by others (a 0700 parent made every
non-root client fail with CUDA error 805). `start` checks both and says what to change.
The container runtime must find `<root>` at the same path on the host (`host_root` if not).

The daemon sees only the claim's GPUs (`CUDA_VISIBLE_DEVICES=<uuid>,...`), so client
device index i is `settings.devices[i]`. Limits are set twice: as defaults in the control
daemon (`set_default_*`, which apply to every server it starts) and as the client
variables in the container (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`,
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`).

The daemon is stopped with `quit` written to `nvidia-cuda-mps-control` (client mode); its
processes are found by a marker variable in their environment
(`GPU_DRA_MPS_CLAIM=<uid>`), so a stop after a plugin restart finds them too, and a daemon
that does not quit is killed by PID.

`settings_for_claim` and `MpsControl.container_edits` are pure; the other methods of
`MpsControl` do blocking I/O (call them from a thread in async code).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import structlog

from dra_driver.atomic import write_file_atomic
from dra_driver.cdi.spec import ContainerEdits, Mount, validate_claim_uid
from dra_driver.driver_root import BINARY_DIRS, library_dirs, resolve_in_root
from dra_driver.gpu import compute_mode
from dra_driver.gpu.compute_mode import ComputeModeError, ComputeModes
from dra_driver.sharing.config import DEFAULT_SHM_SIZE, ConfigError, MpsConfig, format_mps_memory

log = structlog.get_logger(__name__)

CONTROL_BINARY: Final = "nvidia-cuda-mps-control"
CONTAINER_PIPE_DIR: Final = "/tmp/nvidia-mps"  # the default CUDA itself uses
CONTAINER_SHM_DIR: Final = "/dev/shm"
CLAIM_MARKER_ENV: Final = "GPU_DRA_MPS_CLAIM"
SETTINGS_FILE: Final = "settings.json"
PID_FILE: Final = "daemon.pid"
OWNER_FILE: Final = "owner.json"  # in the root: the driver whose daemons live under it
COMPUTE_MODE_FILE: Final = "compute-mode.json"  # the modes found before exclusive-process was set
MOUNT_OPTIONS: Final = ("rw", "nosuid", "nodev", "bind")
# Modes, no wider than MPS needs. The claim's directory: others may pass through it by name
# (the MPS server runs as the client's user and must reach pipe/ and log/), not list it.
# pipe/ and log/: the daemon runs as root but starts each MPS server as its first client's
# user, unknown at Prepare, and that server creates its pipes and its log there; so every
# user may create files (w+x), nobody but root may list them, and the sticky bit keeps one
# user from removing another's. shm/ is a tmpfs of its own with /dev/shm's usual 1777.
BASE_MODE: Final = 0o711
PIPE_LOG_MODE: Final = 0o1733
SHM_MODE: Final = 0o1777
_MNT_DETACH: Final = 2


class MpsError(Exception):
    """An MPS daemon could not be started or stopped; the message says what happened."""


class MpsRootRefused(MpsError):
    """The plugin must not start on this MPS root; the message says what to change."""


class MpsRootOfAnotherDriver(MpsRootRefused):
    """The MPS root is another driver's (two releases given one mpsRoot): a plugin must
    neither adopt nor stop daemons it did not start, nor delete their directories."""

    def __init__(self, root: Path, owner: str, driver: str) -> None:
        super().__init__(
            f"MPS root {root} belongs to driver {owner}, and this plugin is driver {driver}: two "
            "drivers must not share an MPS root (this plugin would stop the other's MPS daemons and "
            "remove their pipe directories under its running pods). Give each release its own "
            "(--mps-root; the chart's mpsRoot; both default to /run/<driver name>/mps) and restart "
            f"this plugin; nothing under {root} was changed"
        )
        self.root = root
        self.owner = owner
        self.driver = driver


@dataclass(frozen=True)
class MpsDevice:
    """One GPU (or MIG device) the claim's daemon serves."""

    uuid: str
    pinned_memory_limit: int | None = None  # bytes per client; None: no limit


@dataclass(frozen=True)
class MpsSettings:
    """What one claim's daemon is started with. Client device index i is `devices[i]`."""

    claim_uid: str
    devices: tuple[MpsDevice, ...]
    active_thread_percentage: int | None = None
    shm_size: int = DEFAULT_SHM_SIZE  # bytes of the claim's /dev/shm tmpfs
    # whole GPUs the claim owns: exclusive-process mode while its daemon runs (if allowed)
    exclusive_gpus: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "claimUID": self.claim_uid,
            "devices": [{"uuid": d.uuid, "pinnedMemoryLimit": d.pinned_memory_limit} for d in self.devices],
            "activeThreadPercentage": self.active_thread_percentage,
            "shmSize": self.shm_size,
            "exclusiveGPUs": list(self.exclusive_gpus),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> MpsSettings:
        return cls(
            claim_uid=str(obj["claimUID"]),
            devices=tuple(
                MpsDevice(
                    str(d["uuid"]), None if d["pinnedMemoryLimit"] is None else int(d["pinnedMemoryLimit"])
                )
                for d in obj["devices"]
            ),
            active_thread_percentage=None
            if obj.get("activeThreadPercentage") is None
            else int(obj["activeThreadPercentage"]),
            shm_size=int(obj.get("shmSize", DEFAULT_SHM_SIZE)),
            exclusive_gpus=tuple(str(u) for u in obj.get("exclusiveGPUs", ())),
        )


def settings_for_claim(claim_uid: str, devices: Sequence[tuple[str, MpsConfig]]) -> MpsSettings:
    """The daemon settings of a claim from its MPS devices `(uuid, config)`, in client order.

    The active thread percentage applies to every client of the daemon, so all the
    claim's MPS devices must agree on it; the claim's /dev/shm is the largest any asks for."""
    if not devices:
        raise ValueError(f"claim {claim_uid}: an MPS daemon needs at least one device")
    percentages = sorted({c.default_active_thread_percentage for _, c in devices}, key=str)
    if len(percentages) > 1:
        raise ConfigError(
            "all MPS devices of one claim share one daemon and must have the same "
            f"mps.defaultActiveThreadPercentage (got {', '.join(map(str, percentages))})"
        )
    return MpsSettings(
        claim_uid=claim_uid,
        devices=tuple(MpsDevice(uuid, c.default_pinned_device_memory_limit) for uuid, c in devices),
        active_thread_percentage=percentages[0],
        shm_size=max((c.shm_size for _, c in devices if c.shm_size is not None), default=DEFAULT_SHM_SIZE),
    )


def control_commands(settings: MpsSettings) -> tuple[str, ...]:
    """The `nvidia-cuda-mps-control` commands that make the limits the daemon's defaults."""
    cmds = []
    if settings.active_thread_percentage is not None:
        cmds.append(f"set_default_active_thread_percentage {settings.active_thread_percentage}")
    for i, d in enumerate(settings.devices):
        if d.pinned_memory_limit is not None:
            cmds.append(f"set_default_device_pinned_mem_limit {i} {format_mps_memory(d.pinned_memory_limit)}")
    return tuple(cmds)


def client_env(settings: MpsSettings) -> tuple[str, ...]:
    """The variables an MPS client of this claim runs with."""
    env = [f"CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}"]
    limits = [
        f"{i}={format_mps_memory(d.pinned_memory_limit)}"
        for i, d in enumerate(settings.devices)
        if d.pinned_memory_limit is not None
    ]
    if limits:
        env.append(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={','.join(limits)}")
    if settings.active_thread_percentage is not None:
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={settings.active_thread_percentage}")
    return tuple(env)


# The longest socket name the control daemon creates in its pipe directory (seen on the
# H200 host: control, control_privileged, log, control_lock, nvidia-cuda-mps-control.pid).
_LONGEST_SOCKET_NAME: Final = "control_privileged"
_SUN_PATH_MAX: Final = 107  # sockaddr_un.sun_path holds 108 bytes with the final NUL


def check_pipe_dir_length(pipe_dir: Path) -> None:
    """MPS binds UNIX sockets in the pipe directory; a longer path makes the control daemon
    exit 1 without a word (seen on the H200 host with a 101-character directory)."""
    longest = len(os.fsencode(pipe_dir)) + 1 + len(_LONGEST_SOCKET_NAME)
    if longest > _SUN_PATH_MAX:
        raise MpsError(
            f"the MPS pipe directory {pipe_dir} is too long for UNIX socket paths "
            f"({longest} > {_SUN_PATH_MAX} bytes for its control_privileged socket); "
            "choose a shorter MPS root (the default is "
            f"{default_root('<driver>')})"
        )


def check_searchable(path: Path) -> None:
    """Every directory above `path` must let other users through: the control daemon starts
    each client's MPS server as that client's user, and a server that cannot reach the pipe
    directory exits at once (the client then fails with CUDA error 805; seen on the H200
    host with a 0700 parent)."""
    for parent in path.parents:
        mode = os.stat(parent).st_mode
        if not mode & stat.S_IXOTH:
            raise MpsError(
                f"{parent} (mode {stat.S_IMODE(mode):04o}) is not searchable by other users, so MPS "
                f"servers started for non-root clients cannot reach {path}; make it 0755 or choose "
                "another MPS root"
            )


def default_root(driver: str) -> Path:
    """Where a node keeps its claims' MPS directories by default: short (UNIX socket paths)
    and on a tmpfs (the daemons die with the boot). The container runtime must find the
    same path on the host: run the plugin with that directory mounted from the host."""
    return Path("/run") / driver / "mps"


def find_control_binary(driver_root: str | os.PathLike[str]) -> Path | None:
    """`nvidia-cuda-mps-control` under the driver root (as this process sees it)."""
    root = os.fspath(driver_root)
    for d in BINARY_DIRS:
        real = resolve_in_root(root, f"{d}/{CONTROL_BINARY}")
        if real is not None:
            path = Path(root, real.lstrip("/"))
            if path.is_file() and os.access(path, os.X_OK):
                return path
    return None


@dataclass(frozen=True)
class ClaimDirs:
    base: Path

    @property
    def pipe(self) -> Path:
        return self.base / "pipe"

    @property
    def log(self) -> Path:
        return self.base / "log"

    @property
    def shm(self) -> Path:
        return self.base / "shm"

    @property
    def settings(self) -> Path:
        return self.base / SETTINGS_FILE

    @property
    def pid_file(self) -> Path:
        return self.base / PID_FILE

    @property
    def compute_mode_file(self) -> Path:
        return self.base / COMPUTE_MODE_FILE


class MpsControl:
    """Starts, finds and stops the per-claim MPS control daemons of this node.

    `root` is where this process keeps the claims' directories, `host_root` where the
    container runtime finds that same directory (the CDI mounts); `driver_root` is where
    this process sees the driver's files. `private_shm=False` leaves the daemon on the
    host's /dev/shm and mounts none into the container (for tests that cannot mount; a real
    node needs True: each claim then gets a tmpfs of its own, of the claim's shm size).
    `host_cgroup=True` starts each daemon in the cgroups of PID 1 (see `mps_launch`), so
    that it outlives the plugin's container; it needs the host's PID namespace.
    `compute`: where the operator lets the driver change compute mode, the GPUs of a claim's
    `exclusive_gpus` are set to exclusive-process before its daemon starts, the mode found
    recorded first in the claim's directory, and put back by `stop` when no other claim's
    record names the GPU; a GPU whose mode cannot be set refuses the claim."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        driver_root: str | os.PathLike[str],
        *,
        host_root: str | os.PathLike[str] | None = None,
        private_shm: bool = True,
        host_cgroup: bool = False,
        compute: ComputeModes | None = None,
        control_binary: str | os.PathLike[str] | None = None,
        start_timeout: float = 15.0,
        stop_timeout: float = 15.0,
    ) -> None:
        self.root = Path(root)
        self.host_root = Path(host_root) if host_root is not None else self.root
        self.driver_root = Path(driver_root)
        self.private_shm = private_shm
        self.host_cgroup = host_cgroup
        self.compute = compute
        self._control_binary = Path(control_binary) if control_binary is not None else None
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout

    # -- paths and pure parts ----------------------------------------------------------

    def dirs(self, claim_uid: str) -> ClaimDirs:
        validate_claim_uid(claim_uid)  # it names a directory
        return ClaimDirs(self.root / claim_uid)

    def container_edits(self, settings: MpsSettings) -> ContainerEdits:
        """What each of the claim's containers needs to be a client of its daemon."""
        host = ClaimDirs(self.host_root / settings.claim_uid)
        mounts = [Mount(str(host.pipe), CONTAINER_PIPE_DIR, MOUNT_OPTIONS)]
        if self.private_shm:
            mounts.append(Mount(str(host.shm), CONTAINER_SHM_DIR, MOUNT_OPTIONS))
        return ContainerEdits(env=client_env(settings), mounts=tuple(mounts))

    def control_binary(self) -> Path:
        found = self._control_binary or find_control_binary(self.driver_root)
        if found is None:
            raise MpsError(
                f"{CONTROL_BINARY} not found under the driver root {self.driver_root} "
                f"(looked in {', '.join(BINARY_DIRS)}): MPS sharing needs the driver's MPS tools"
            )
        return found

    def _env(self, dirs: ClaimDirs, settings: MpsSettings | None = None) -> dict[str, str]:
        binary = self.control_binary()
        lib_dirs = [str(self.driver_root / d) for d in library_dirs() if (self.driver_root / d).is_dir()]
        env = {
            # the control daemon starts nvidia-cuda-mps-server from its PATH
            "PATH": os.pathsep.join(
                [
                    str(binary.parent),
                    "/usr/local/sbin",
                    "/usr/local/bin",
                    "/usr/sbin",
                    "/usr/bin",
                    "/sbin",
                    "/bin",
                ]
            ),
            "CUDA_MPS_PIPE_DIRECTORY": str(dirs.pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(dirs.log),
        }
        if lib_dirs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_dirs)
        if settings is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(d.uuid for d in settings.devices)
            env[CLAIM_MARKER_ENV] = settings.claim_uid
        return env

    def claim_root(self, driver: str) -> None:
        """Make the MPS root this driver's, at start and before anything under it is read:
        raises MpsRootOfAnotherDriver if another driver's owner file is there (as the
        checkpoint refuses a state dir of another driver). A root without one (new, or
        kept by a build before owner files) is taken."""
        path = self.root / OWNER_FILE
        try:
            owner = json.loads(path.read_text()).get("driver")
        except FileNotFoundError:
            owner = None
        except (OSError, ValueError, AttributeError) as e:
            raise MpsRootRefused(f"MPS root owner file {path} cannot be read ({e}); remove it if no other "
                           "driver uses this MPS root, and restart this plugin") from None
        if owner is not None and owner != driver:
            raise MpsRootOfAnotherDriver(self.root, str(owner), driver)
        if owner is None:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o755)
            write_file_atomic(path, json.dumps({"driver": driver}).encode())

    # -- state on disk and in /proc ----------------------------------------------------

    def claim_uids(self) -> frozenset[str]:
        """Claims that have a daemon directory here (running or not)."""
        try:
            return frozenset(p.name for p in self.root.iterdir() if p.is_dir())
        except FileNotFoundError:
            return frozenset()

    def has_state(self, claim_uid: str) -> bool:
        """Whether the claim has a daemon directory (every start creates it first: no
        directory, no daemon)."""
        return self.dirs(claim_uid).base.exists()

    def saved_settings(self, claim_uid: str) -> MpsSettings | None:
        try:
            text = self.dirs(claim_uid).settings.read_text()
        except FileNotFoundError:
            return None
        try:
            return MpsSettings.from_json(json.loads(text))
        except (ValueError, KeyError, TypeError) as e:
            log.error(
                "unreadable MPS settings file; treating the daemon as unknown",
                claim_uid=claim_uid,
                error=str(e),
            )
            return None

    def daemon_pids(self, claim_uid: str) -> tuple[int, ...]:
        """Processes (control daemon, servers) started for this claim, found by their marker.
        With the host's PID namespace that includes those an earlier plugin started."""
        return tuple(sorted(pid for pid in _proc_pids() if _has_marker(pid, claim_uid)))

    def daemon_pid(self, claim_uid: str) -> int | None:
        """The claim's control daemon from its pid file, if that process is alive and is
        the claim's (a PID reused by another process does not carry the claim's marker)."""
        try:
            pid = int(self.dirs(claim_uid).pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _has_marker(pid, claim_uid) else None

    def is_running(self, claim_uid: str) -> bool:
        if self.daemon_pid(claim_uid) is not None:
            return True
        return bool(self.daemon_pids(claim_uid))  # a daemon started before pid files

    # -- start and stop ----------------------------------------------------------------

    def start(self, settings: MpsSettings) -> None:
        """Start the claim's daemon; a no-op if it already runs with these settings.

        A daemon that died is started again in the same directories, which running
        containers have mounted: a directory is only removed by `stop`."""
        uid = settings.claim_uid
        dirs = self.dirs(uid)
        if self.is_running(uid):
            if self.saved_settings(uid) == settings:
                return
            log.warning("MPS daemon of the claim runs with other settings; restarting it", claim_uid=uid)
            self._end_processes(uid)
        fresh = not dirs.base.exists()
        binary = self.control_binary()
        check_pipe_dir_length(dirs.pipe)
        if self.private_shm and not _is_mount_point(dirs.shm):
            check_shm_size(settings.shm_size, self.root)
        try:
            self._launch(binary, dirs, settings)
        except MpsError:
            self._end_processes(uid)
            if fresh:
                self._remove(uid)
            raise
        log.info(
            "MPS control daemon started",
            claim_uid=uid,
            devices=[d.uuid for d in settings.devices],
            pids=list(self.daemon_pids(uid)),
            shm_size=settings.shm_size if self.private_shm else None,
            host_cgroup=self.host_cgroup,
        )

    def _make_dirs(self, dirs: ClaimDirs, settings: MpsSettings) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o755)
        dirs.base.mkdir(exist_ok=True, mode=BASE_MODE)
        os.chmod(dirs.base, BASE_MODE)
        for d in (dirs.pipe, dirs.log, dirs.shm):
            d.mkdir(exist_ok=True)
        for d in (dirs.pipe, dirs.log):
            os.chmod(d, PIPE_LOG_MODE)
            check_searchable(d)
        if self.private_shm and not _is_mount_point(dirs.shm):
            mount_tmpfs(dirs.shm, settings.shm_size)
        elif not self.private_shm:
            os.chmod(dirs.shm, SHM_MODE)
        for stale in dirs.pipe.iterdir():  # a dead daemon's pipes and sockets
            stale.unlink(missing_ok=True)

    def _launch(self, binary: Path, dirs: ClaimDirs, settings: MpsSettings) -> None:
        uid = settings.claim_uid
        self._make_dirs(dirs, settings)
        self._set_exclusive(dirs, settings)
        write_file_atomic(dirs.settings, (json.dumps(settings.to_json(), indent=2) + "\n").encode())
        cmd = [str(binary), "-d"]
        launch = []
        if self.host_cgroup:
            launch += ["--join-cgroups-of", "1"]
        if self.private_shm:
            launch += ["--shm", str(dirs.shm)]
        if launch:
            cmd = [sys.executable, "-m", "dra_driver.sharing.mps_launch", *launch, "--", *cmd]
        start_log = dirs.log / "start.log"
        with open(start_log, "wb") as out:  # never a pipe: the daemon would hold it open
            try:
                rc = subprocess.run(
                    cmd,
                    env={**self._env(dirs, settings), **_python_env()},
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=self.start_timeout,
                    check=False,
                    start_new_session=True,
                ).returncode
            except (OSError, subprocess.TimeoutExpired) as e:
                raise MpsError(f"starting the MPS control daemon failed: {e}") from e
        if rc != 0:
            raise MpsError(f"starting the MPS control daemon failed (exit {rc}): {_tail(start_log)}")
        if not _wait_for(lambda: (dirs.pipe / "control").exists(), self.start_timeout):
            detail = _tail(dirs.log / "control.log") or _tail(start_log)
            detail += f" (pipe directory holds: {sorted(os.listdir(dirs.pipe))})"
            raise MpsError(
                f"the MPS control daemon did not open its control pipe in {self.start_timeout:.0f}s: "
                f"{detail or 'no log'}"
            )
        pids = self.daemon_pids(uid)  # no client yet: the control daemon alone
        if pids:
            write_file_atomic(dirs.pid_file, f"{pids[0]}\n".encode())
        for command in control_commands(settings):
            self._send(dirs, command, settings)

    def send(self, claim_uid: str, command: str) -> str:
        """Send one command to the claim's control daemon; returns its answer."""
        return self._send(self.dirs(claim_uid), command, self.saved_settings(claim_uid))

    def _send(self, dirs: ClaimDirs, command: str, settings: MpsSettings | None) -> str:
        try:
            done = subprocess.run(
                [str(self.control_binary())],
                input=command + "\n",
                env=self._env(dirs),
                capture_output=True,
                text=True,
                timeout=self.stop_timeout,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsError(f"sending {command!r} to the MPS control daemon failed: {e}") from e
        answer = (done.stdout + done.stderr).strip()
        if done.returncode != 0:
            log.warning(
                "MPS control command failed",
                command=command,
                exit_code=done.returncode,
                answer=answer,
                claim_uid=settings.claim_uid if settings else None,
            )
        return answer

    def stop(self, claim_uid: str) -> bool:
        """Stop the claim's daemon and remove its directory; True if there was anything to stop.

        Idempotent. `quit` first (the daemon stops its servers); processes still there after
        `stop_timeout` get SIGTERM, then SIGKILL. Raises MpsError only if one survives that."""
        if not self.has_state(claim_uid):
            return False
        had = self._end_processes(claim_uid)
        self._remove(claim_uid)
        log.info("MPS control daemon stopped", claim_uid=claim_uid, had_processes=had)
        return True

    def _end_processes(self, claim_uid: str) -> bool:
        """End the claim's processes, and only those; True if there were any."""
        dirs = self.dirs(claim_uid)
        pids = self.daemon_pids(claim_uid)
        if pids and (dirs.pipe / "control").exists():
            try:
                self._send(dirs, "quit", None)
            except MpsError as e:
                log.warning(
                    "MPS daemon did not take 'quit'; it will be killed", claim_uid=claim_uid, error=str(e)
                )
            _wait_for(lambda: not self.daemon_pids(claim_uid), self.stop_timeout)
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            left = self.daemon_pids(claim_uid)
            if not left:
                break
            log.warning(
                "MPS processes still running; signalling",
                claim_uid=claim_uid,
                pids=list(left),
                signal=sig.name,
            )
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            _wait_for(lambda: not self.daemon_pids(claim_uid), wait)
        left = self.daemon_pids(claim_uid)
        if left:
            raise MpsError(f"MPS processes {list(left)} of claim {claim_uid} survived SIGKILL")
        return bool(pids)

    # -- compute mode -----------------------------------------------------------------

    def _recorded_modes(self, except_uid: str | None = None) -> dict[str, dict[str, int]]:
        """Claim UID -> {GPU UUID: the mode found before it was set exclusive}."""
        out = {}
        for uid in self.claim_uids() - {except_uid}:
            try:
                raw = json.loads(self.dirs(uid).compute_mode_file.read_text())
                out[uid] = {str(k): int(v) for k, v in raw.items()}
            except FileNotFoundError:
                continue
            except (ValueError, AttributeError, TypeError) as e:
                log.error("unreadable compute-mode record", claim_uid=uid, error=str(e))
        return out

    def _set_exclusive(self, dirs: ClaimDirs, settings: MpsSettings) -> None:
        if self.compute is None or not settings.exclusive_gpus:
            return
        uid = settings.claim_uid
        others = self._recorded_modes(except_uid=uid)
        try:
            mine = {str(k): int(v) for k, v in json.loads(dirs.compute_mode_file.read_text()).items()}
        except FileNotFoundError:
            mine = {}
        except ValueError:
            mine = {}
        try:
            for gpu in settings.exclusive_gpus:
                if gpu not in mine:
                    # another claim already changed it: the mode to restore is the one it found
                    found = next((r[gpu] for r in others.values() if gpu in r), None)
                    mine[gpu] = self.compute.get(gpu) if found is None else found
                    write_file_atomic(dirs.compute_mode_file, json.dumps(mine).encode())  # before the change
                if self.compute.get(gpu) != compute_mode.EXCLUSIVE_PROCESS:
                    self.compute.set(gpu, compute_mode.EXCLUSIVE_PROCESS)
                    log.info(
                        "GPU set to exclusive-process compute mode for the claim's MPS daemon",
                        claim_uid=uid,
                        gpu=gpu,
                        was=compute_mode.name(mine[gpu]),
                    )
        except ComputeModeError as e:
            raise MpsError(
                f"{e}: this whole-GPU MPS claim needs its GPUs in exclusive-process compute mode (so no "
                "process can use the GPU around MPS); let the driver change compute mode on this node, or "
                "run the plugin with --no-mps-exclusive-compute-mode to accept that"
            ) from e

    def _restore_modes(self, dirs: ClaimDirs, claim_uid: str) -> None:
        try:
            mine = {str(k): int(v) for k, v in json.loads(dirs.compute_mode_file.read_text()).items()}
        except FileNotFoundError:
            return
        except ValueError as e:
            log.error("unreadable compute-mode record; modes left alone", claim_uid=claim_uid, error=str(e))
            return
        if self.compute is None:
            log.warning(
                "the claim changed compute modes, but this plugin may not change them: left as they are",
                claim_uid=claim_uid,
                modes={g: compute_mode.name(m) for g, m in mine.items()},
            )
            return
        still = {g for r in self._recorded_modes(except_uid=claim_uid).values() for g in r}
        for gpu, mode in mine.items():
            if gpu in still:
                continue  # another claim's daemon holds it; that claim restores it
            try:
                if self.compute.get(gpu) != mode:  # not changed (a refused claim): nothing to undo
                    self.compute.set(gpu, mode)
            except ComputeModeError as e:
                raise MpsError(f"restoring the compute mode of the claim's GPU failed: {e}") from e
            log.info("GPU compute mode restored", claim_uid=claim_uid, gpu=gpu, mode=compute_mode.name(mode))

    def _remove(self, claim_uid: str) -> None:
        dirs = self.dirs(claim_uid)
        self._restore_modes(dirs, claim_uid)  # the record goes with the directory, last
        if _is_mount_point(dirs.shm):
            unmount(dirs.shm)
        shutil.rmtree(dirs.base, ignore_errors=True)


# --------------------------------------------------------------------------- helpers


def check_shm_size(size: int, root: Path) -> None:
    """A claim's /dev/shm tmpfs may not be larger than what is free where the MPS root is
    (/run by default), the budget the node set aside for runtime tmpfs."""
    probe = root
    while not probe.exists():
        probe = probe.parent
    st = os.statvfs(probe)
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise MpsError(
            f"mps.shmSize {size} bytes ({size / 2**20:.0f}Mi) is more than the {free / 2**20:.0f}Mi free on "
            f"this node's {probe}: ask for less (the default is {DEFAULT_SHM_SIZE // 2**20}Mi)"
        )


def mount_tmpfs(target: Path, size: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    flags = 0x2 | 0x4  # MS_NOSUID | MS_NODEV
    options = f"size={size},mode={SHM_MODE:o}".encode()
    if libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", flags, options) != 0:
        err = ctypes.get_errno()
        raise MpsError(f"mounting the claim's /dev/shm tmpfs on {target} failed: {os.strerror(err)}")


def unmount(target: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        log.warning("unmounting a claim's /dev/shm tmpfs failed", path=str(target), error=os.strerror(err))


def _is_mount_point(path: Path) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return False


def _python_env() -> dict[str, str]:
    """What the launcher (this interpreter, `-m dra_driver...`) needs to import the driver."""
    return {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "VIRTUAL_ENV")}


def _proc_pids() -> list[int]:
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]


def _has_marker(pid: int, claim_uid: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False
    return f"{CLAIM_MARKER_ENV}={claim_uid}".encode() in environ


def _wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:].strip()
    except OSError:
        return ""
