"""Mount and namespace system calls, through libc (ctypes), for the MPS machinery's two users:
the plugin mounts and unmounts each claim's /dev/shm tmpfs (`dra_driver.sharing.mps.daemon`),
and the launcher (`dra_driver.sharing.mps_launch`) enters PID 1's cgroup namespace and gives
the control daemon a mount namespace with the claim's tmpfs over /dev/shm before it execs it.

libc because the image has no `mount` binary and Python 3.11 has no `os.setns`. Each call
raises OSError (the errno, and what was asked) when the kernel refuses; what to tell the user
is the caller's. It must not decide what to mount or where, nor import the rest of the driver:
the launcher loads it in the short-lived process that becomes the daemon.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Final

CLONE_NEWNS: Final = 0x00020000
CLONE_NEWCGROUP: Final = 0x02000000
MS_NOSUID: Final = 0x2
MS_NODEV: Final = 0x4
MS_BIND: Final = 0x1000
MS_REC: Final = 0x4000
MS_PRIVATE: Final = 1 << 18
MNT_DETACH: Final = 2


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount_tmpfs(target: Path, size: int, mode: int) -> None:
    """A tmpfs of `size` bytes and root `mode` on `target`, nosuid and nodev."""
    options = f"size={size},mode={mode:o}".encode()
    rc = _libc().mount(b"tmpfs", os.fsencode(target), b"tmpfs", MS_NOSUID | MS_NODEV, options)
    _check(rc, f"mounting a tmpfs on {target}")


def unmount(target: Path) -> None:
    """Detach the mount on `target` (lazily, as `umount -l`: a user still inside keeps it)."""
    _check(_libc().umount2(os.fsencode(target), MNT_DETACH), f"unmounting {target}")


def is_mount_point(path: Path) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return False


def enter_cgroup_namespace_of(pid: int) -> None:
    fd = os.open(f"/proc/{pid}/ns/cgroup", os.O_RDONLY)
    try:
        _check(_libc().setns(fd, CLONE_NEWCGROUP), f"entering the cgroup namespace of PID {pid}")
    finally:
        os.close(fd)


def private_mount_namespace() -> None:
    """A mount namespace of this process's own, whose mounts no other namespace sees."""
    libc = _libc()
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making / private")


def bind_mount(source: str, target: str) -> None:
    _check(
        _libc().mount(os.fsencode(source), os.fsencode(target), None, MS_BIND, None),
        f"binding {source} over {target}",
    )
