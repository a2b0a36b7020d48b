"""Where the plugin's sockets and data live, as the kubelet expects them.

    <kubelet-dir>/plugins_registry/<driver>-reg.sock   registration (the kubelet watches this dir)
    <kubelet-dir>/plugins/<driver>/dra.sock            DRA and health services
    <kubelet-dir>/plugins/<driver>/                    plugin data (publisher lease, health history;
                                                       the checkpoint lives in --state-dir)

With rolling updates (two plugin pods on one node for a while) both socket names carry
the pod UID, so old and new instance can be registered at once.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import stat
from dataclasses import dataclass
from pathlib import Path

# sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class PluginPaths:
    registration_socket: Path
    dra_socket: Path
    data_dir: Path


def plugin_paths(kubelet_dir: Path, driver: str, rolling_update_uid: str | None = None) -> PluginPaths:
    registry = kubelet_dir / "plugins_registry"
    data_dir = kubelet_dir / "plugins" / driver
    if not rolling_update_uid:
        return PluginPaths(registry / f"{driver}-reg.sock", data_dir / "dra.sock", data_dir)
    registration = registry / f"{driver}-{rolling_update_uid}-reg.sock"
    if len(str(registration)) > MAX_SOCKET_PATH:
        registration = registry / f"{driver}-{_short_hash(rolling_update_uid, 8)}-reg.sock"
    if len(str(registration)) > MAX_SOCKET_PATH:
        registration = registry / f"dra-{_short_hash(driver + chr(0) + rolling_update_uid, 16)}-reg.sock"
    return PluginPaths(registration, data_dir / f"dra-{rolling_update_uid}.sock", data_dir)


def _short_hash(value: str, size: int) -> str:
    digest = hashlib.sha256(value.encode()).digest()[:size]
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def prepare_socket_path(path: Path) -> None:
    """Make the directory (owner and group only) and remove a stale socket file.

    Anything other than a socket at that path is left alone and reported: deleting a
    user's file because its name collides would be worse than not starting.
    """
    if len(str(path)) > MAX_SOCKET_PATH:
        raise ValueError(
            f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; use a shorter --kubelet-dir"
        )
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    with contextlib.suppress(FileNotFoundError):
        mode = path.lstat().st_mode
        if not stat.S_ISSOCK(mode):
            raise FileExistsError(
                f"{path} exists and is not a socket; remove it or choose another --kubelet-dir"
            )
        path.unlink()


# Only the owner (the kubelet runs as root) may connect.
SOCKET_MODE = 0o600
