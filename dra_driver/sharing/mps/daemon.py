"""The claims' MPS control daemons: start one with its settings, send it commands, stop it.

A claim whose configuration says `sharing.strategy: MPS` (see `dra_driver.sharing.config`)
gets its own `nvidia-cuda-mps-control -d`, started by the kubelet plugin during Prepare from
the driver root's tools, in the claim's directories (`layout.ClaimDirs`); `container_edits`
is what each of the claim's containers gets to be its client. The daemon is stopped with
`quit` written to `nvidia-cuda-mps-control` (client mode); a daemon that does not quit is
killed by PID, its processes found by their marker (`adoption`). A GPU's compute mode is
changed and put back through `compute_modes`, the claim's /dev/shm tmpfs mounted through
`dra_driver.sharing.mounts`.

`container_edits` is pure; the other methods of `MpsControl` do blocking I/O (call them
from a thread in async code). It must not decide whether a claim gets MPS
(`dra_driver.sharing.policy` does) nor write CDI specs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Set
from pathlib import Path

import structlog

from dra_driver.atomic import write_file_atomic
from dra_driver.cdi.spec import ContainerEdits, Mount, validate_claim_uid
from dra_driver.driver_root.user_space import BINARY_DIRS, library_dirs
from dra_driver.gpu.compute_mode import ComputeModes
from dra_driver.sharing import mounts
from dra_driver.sharing.mps import adoption, compute_modes
from dra_driver.sharing.mps.adoption import CLAIM_MARKER_ENV
from dra_driver.sharing.mps.errors import MpsError
from dra_driver.sharing.mps.layout import (
    BASE_MODE,
    CONTROL_BINARY,
    MOUNT_OPTIONS,
    PIPE_LOG_MODE,
    SHM_MODE,
    ClaimDirs,
    check_pipe_dir_length,
    check_searchable,
    check_shm_size,
    find_control_binary,
)
from dra_driver.sharing.mps.settings import (
    CONTAINER_PIPE_DIR,
    CONTAINER_SHM_DIR,
    MpsSettings,
    client_env,
    control_commands,
)

log = structlog.get_logger(__name__)


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

    def claim_root(
        self, driver: str, known: Callable[[], Set[str]] = frozenset, api_unanswered: bool = False
    ) -> None:
        """Make the MPS root this driver's; `known`: the claims this driver has prepared here
        (see `adoption.claim_root`)."""
        adoption.claim_root(self.root, driver, known, api_unanswered)

    def live_claims(self) -> frozenset[str]:
        """Claims with a directory here whose daemon is alive."""
        return adoption.live_claims(self.root)

    # -- state on disk and in /proc ----------------------------------------------------

    def claim_uids(self) -> frozenset[str]:
        """Claims that have a daemon directory here (running or not)."""
        return adoption.claim_uids(self.root)

    def has_state(self, claim_uid: str) -> bool:
        """Whether the claim has a daemon directory (every start creates it first: no
        directory, no daemon)."""
        return self.dirs(claim_uid).base.exists()

    def saved_settings(self, claim_uid: str) -> MpsSettings | None:
        return adoption.saved_settings(self.dirs(claim_uid), claim_uid)

    def daemon_pids(self, claim_uid: str) -> tuple[int, ...]:
        """Processes (control daemon, servers) started for this claim (see `adoption`)."""
        return adoption.daemon_pids(claim_uid)

    def daemon_pid(self, claim_uid: str) -> int | None:
        return adoption.daemon_pid(self.dirs(claim_uid), claim_uid)

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
        if self.private_shm and not mounts.is_mount_point(dirs.shm):
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
        if self.private_shm and not mounts.is_mount_point(dirs.shm):
            _mount_tmpfs(dirs.shm, settings.shm_size)
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
        return compute_modes.recorded_modes((uid, self.dirs(uid)) for uid in self.claim_uids() - {except_uid})

    def _set_exclusive(self, dirs: ClaimDirs, settings: MpsSettings) -> None:
        if self.compute is None or not settings.exclusive_gpus:
            return
        others = self._recorded_modes(except_uid=settings.claim_uid)
        compute_modes.set_exclusive(self.compute, dirs, settings, others)

    def _remove(self, claim_uid: str) -> None:
        dirs = self.dirs(claim_uid)
        # the record goes with the directory, last
        compute_modes.restore_modes(
            self.compute, dirs, claim_uid, lambda: self._recorded_modes(except_uid=claim_uid)
        )
        if mounts.is_mount_point(dirs.shm):
            _unmount(dirs.shm)
        shutil.rmtree(dirs.base, ignore_errors=True)


def _mount_tmpfs(target: Path, size: int) -> None:
    try:
        mounts.mount_tmpfs(target, size, SHM_MODE)
    except OSError as e:
        raise MpsError(
            f"mounting the claim's /dev/shm tmpfs on {target} failed: {os.strerror(e.errno or 0)}"
        ) from None


def _unmount(target: Path) -> None:
    try:
        mounts.unmount(target)
    except OSError as e:
        error = os.strerror(e.errno or 0)
        log.warning("unmounting a claim's /dev/shm tmpfs failed", path=str(target), error=error)


def _python_env() -> dict[str, str]:
    """What the launcher (this interpreter, `-m dra_driver...`) needs to import the driver."""
    return {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "VIRTUAL_ENV")}


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
