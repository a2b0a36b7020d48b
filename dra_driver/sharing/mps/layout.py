"""Where a claim's MPS daemon keeps its files, and the rules that place puts on the node.

Everything private to a claim is under `<root>/<claim uid>/` (`ClaimDirs`):

    pipe/   CUDA_MPS_PIPE_DIRECTORY: the daemon's and servers' named pipes and sockets;
            mounted into the claim's containers at `CONTAINER_PIPE_DIR`
    log/    CUDA_MPS_LOG_DIRECTORY: control.log, server.log
    shm/    the daemon's /dev/shm (MPS clients and servers share memory through it); the
            daemon runs in its own mount namespace with this directory over /dev/shm, and
            the containers get it as their /dev/shm, so a claim never sees the host's
            /dev/shm nor another claim's (the NVIDIA device plugin does the same with a tmpfs)
    settings.json   what the daemon was started with (`settings.MpsSettings`)

Two facts of MPS, both seen on the H200 host, constrain `<root>` (default
`/run/<driver>/mps`, see `default_root`): the daemon binds UNIX sockets in the pipe
directory, so its path must stay short (a 101-character one made the daemon exit 1
silently); and it starts each client's server as that client's user, so every directory
above the pipe and log directories must be searchable by others (a 0700 parent made every
non-root client fail with CUDA error 805). The checks here say what to change.

It reads the file system (stat, statvfs, the driver root) and must not change it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from dra_driver.driver_root.user_space import find_tool
from dra_driver.sharing.config import DEFAULT_SHM_SIZE
from dra_driver.sharing.mps.errors import MpsError

CONTROL_BINARY: Final = "nvidia-cuda-mps-control"
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
    found = find_tool(driver_root, CONTROL_BINARY)
    return Path(found) if found is not None else None


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
