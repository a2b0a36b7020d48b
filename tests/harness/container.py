"""A minimal container made from CDI container edits, for the hardware tests.

No runc, crun or nvidia-ctk is needed: `run_container` starts the workload in new mount
and PID namespaces (`unshare --mount --pid --fork --mount-proc --propagation private`),
with the host's filesystem as the image and exactly what a CDI-aware runtime adds:

* `/dev` is a fresh tmpfs holding only the ordinary container set (null zero random
  urandom full tty, ptmx, /dev/pts, /dev/shm, /dev/fd and the std links) plus the edits'
  device nodes, created with mknod from their type/major/minor;
* the NVIDIA driver's files the host has outside the edits are made absent first:
  `hide` paths (the driver root) get an empty tmpfs, and in `mask_dirs` (where the host
  keeps copies, e.g. /usr/lib/x86_64-linux-gnu) every file matching `DRIVER_FILE_PATTERN`
  disappears, so the driver can only come from the edits' mounts;
* the edits' mounts are bind-mounted (read-only where they say so), their env is applied
  over a small base environment;
* the workload runs as an unprivileged user (uid/gid 65534 by default, no new privileges),
  because as root NVML re-creates a missing /dev/nvidiaN by itself; and, where the kernel
  allows it, under a cgroup v2 device filter (a BPF_PROG_TYPE_CGROUP_DEVICE program, as
  runc builds one) that allows only the ordinary devices and the edits' nodes.

A directory that must receive a new entry (a mount point that does not exist, a masked
library) is never written on the host: it is *shadowed*, i.e. replaced inside the mount
namespace by a tmpfs whose entries are bind mounts of the original ones (minus the
masked files), so nothing outside the namespace changes.

Edits come from CDI spec files (`edits_from_cdi`, a reader independent of the driver's
own CDI builder) or from an OCI spec that the real CDI library injected (`edits_from_oci`,
e.g. the output of hack/cluster's `cdicheck`). Needs root, util-linux `unshare`, Linux.

This file is also the container's init (`python container.py --init PLAN`): that part
runs inside the namespaces, so the module imports the standard library only.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

NOBODY: Final = 65534

# Files of the NVIDIA driver's user space (libraries and tools), by file name.
DRIVER_FILE_PATTERN: Final = (
    r"^(libcuda|libcudadebugger|libnvcuvid|libnvoptix|libnvidia-.+|lib(GLX|EGL|GLESv1_CM|GLESv2)_nvidia"
    r"|libvdpau_nvidia)\.so(\..*)?$"
    r"|^nvidia-(smi|debugdump|persistenced|cuda-mps-control|cuda-mps-server)$"
)
DEFAULT_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# (path, major, minor) of the ordinary container devices, as runc creates them.
ORDINARY_DEVICES: Final = (
    ("/dev/null", 1, 3),
    ("/dev/zero", 1, 5),
    ("/dev/full", 1, 7),
    ("/dev/random", 1, 8),
    ("/dev/urandom", 1, 9),
    ("/dev/tty", 5, 0),
)


class ContainerError(Exception):
    """The container could not be described or set up."""


# --------------------------------------------------------------------------- edits


@dataclass(frozen=True)
class DeviceNodeEdit:
    path: str  # inside the container
    type: str  # "c" or "b"
    major: int
    minor: int
    file_mode: int = 0o666
    uid: int = 0
    gid: int = 0


@dataclass(frozen=True)
class MountEdit:
    source: str
    destination: str
    options: tuple[str, ...] = ()
    type: str | None = None


@dataclass(frozen=True)
class DeviceRule:
    """One device-cgroup rule (OCI `linux.resources.devices[]`). None = any."""

    allow: bool
    type: str = "a"  # "c", "b" or "a" (all)
    major: int | None = None
    minor: int | None = None
    access: str = "rwm"


@dataclass(frozen=True)
class Edits:
    """What a runtime adds to a container for some CDI devices."""

    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNodeEdit, ...] = ()
    mounts: tuple[MountEdit, ...] = ()
    device_rules: tuple[DeviceRule, ...] = ()

    def without_device(self, path: str) -> Edits:
        """The same edits minus one device node and its cgroup rule (for negative controls)."""
        node = next((n for n in self.device_nodes if n.path == path), None)
        if node is None:
            raise ContainerError(f"no device node {path} in the edits")
        rules = tuple(r for r in self.device_rules if not (r.major == node.major and r.minor == node.minor))
        return Edits(self.env, tuple(n for n in self.device_nodes if n.path != path), self.mounts, rules)

    def with_env(self, *env: str) -> Edits:
        return Edits(_merge_env(self.env, env), self.device_nodes, self.mounts, self.device_rules)


def _env_key(entry: str) -> str:
    return entry.split("=", 1)[0]


def _merge_env(base: Iterable[str], extra: Iterable[str]) -> tuple[str, ...]:
    """`extra` over `base`, by key; a replaced key keeps its place (as OCI spec generators do)."""
    out: dict[str, str] = {}
    for entry in [*base, *extra]:
        out[_env_key(entry)] = entry
    return tuple(out.values())


def _stat_node(path: str) -> tuple[str, int, int, int]:
    st = os.stat(path)
    if stat.S_ISCHR(st.st_mode):
        kind = "c"
    elif stat.S_ISBLK(st.st_mode):
        kind = "b"
    else:
        raise ContainerError(f"{path} is not a device node")
    return kind, os.major(st.st_rdev), os.minor(st.st_rdev), stat.S_IMODE(st.st_mode)


def _node_from_cdi(obj: Mapping[str, Any]) -> DeviceNodeEdit:
    path = str(obj["path"])
    kind, major, minor, mode = obj.get("type"), obj.get("major"), obj.get("minor"), obj.get("fileMode")
    if major is None or minor is None or kind is None:
        # As the CDI library does: what the spec leaves out is read from the host's node.
        h_kind, h_major, h_minor, h_mode = _stat_node(str(obj.get("hostPath") or path))
        kind = kind or h_kind
        major = h_major if major is None else major
        minor = h_minor if minor is None else minor
        mode = h_mode if mode is None else mode
    return DeviceNodeEdit(
        path=path,
        type=str(kind),
        major=int(major),
        minor=int(minor),
        file_mode=0o666 if mode is None else int(mode) & 0o7777,
        uid=int(obj.get("uid") or 0),
        gid=int(obj.get("gid") or 0),
    )


def _mount_from_cdi(obj: Mapping[str, Any]) -> MountEdit:
    return MountEdit(
        source=str(obj["hostPath"]),
        destination=str(obj["containerPath"]),
        options=tuple(obj.get("options") or ()),
        type=obj.get("type") or None,
    )


def _depth(path: str) -> int:
    return len([p for p in path.split("/") if p])


def _finish(
    env: list[str], nodes: list[DeviceNodeEdit], mounts: list[MountEdit], rules: list[DeviceRule]
) -> Edits:
    by_path = {n.path: n for n in nodes}  # a later node of the same path replaces the earlier
    by_dest = {m.destination: m for m in mounts}
    return Edits(
        env=_merge_env((), env),
        device_nodes=tuple(by_path.values()),
        # parents before children, as the CDI library sorts them
        mounts=tuple(sorted(by_dest.values(), key=lambda m: _depth(m.destination))),
        device_rules=tuple(rules),
    )


def load_cdi_specs(cdi_dirs: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """Every JSON CDI spec in the directories (YAML specs are not read here)."""
    specs = []
    for d in cdi_dirs:
        for path in sorted(Path(d).glob("*.json")):
            specs.append(json.loads(path.read_text()))
    return specs


def edits_from_cdi(specs: Sequence[Mapping[str, Any]], device_ids: Sequence[str]) -> Edits:
    """The edits of `device_ids` (`vendor/class=name`) as a CDI runtime applies them: each
    spec's own `containerEdits` once if any of its devices is asked for, then each
    device's; env by key, device nodes by path and mounts by destination, later wins."""
    env: list[str] = []
    nodes: list[DeviceNodeEdit] = []
    mounts: list[MountEdit] = []
    used_specs: set[int] = set()
    for device_id in device_ids:
        kind, eq, name = device_id.partition("=")
        if not eq:
            raise ContainerError(f"{device_id!r} is not a qualified CDI device name")
        found = [
            (i, d)
            for i, s in enumerate(specs)
            if s.get("kind") == kind
            for d in s.get("devices", [])
            if d.get("name") == name
        ]
        if len(found) != 1:
            raise ContainerError(f"CDI device {device_id}: found {len(found)} definitions, need exactly one")
        index, device = found[0]
        edit_sets = []
        if index not in used_specs:
            used_specs.add(index)
            edit_sets.append(specs[index].get("containerEdits") or {})
        edit_sets.append(device.get("containerEdits") or {})
        for e in edit_sets:
            env.extend(e.get("env") or ())
            nodes.extend(_node_from_cdi(n) for n in e.get("deviceNodes") or ())
            mounts.extend(_mount_from_cdi(m) for m in e.get("mounts") or ())
            if e.get("hooks"):
                raise ContainerError(f"CDI device {device_id}: hooks are not supported by this runner")
    rules = [DeviceRule(True, n.type, n.major, n.minor, "rwm") for n in {n.path: n for n in nodes}.values()]
    return _finish(env, nodes, mounts, rules)


def edits_from_oci(oci: Mapping[str, Any]) -> Edits:
    """The edits that a CDI library injected into an (otherwise empty) OCI runtime spec."""
    linux = oci.get("linux") or {}
    nodes = [
        DeviceNodeEdit(
            path=str(d["path"]),
            type=str(d.get("type") or "c"),
            major=int(d["major"]),
            minor=int(d["minor"]),
            file_mode=int(d["fileMode"]) & 0o7777 if d.get("fileMode") is not None else 0o666,
            uid=int(d.get("uid") or 0),
            gid=int(d.get("gid") or 0),
        )
        for d in linux.get("devices") or ()
    ]
    mounts = [
        MountEdit(
            source=str(m.get("source", "")),
            destination=str(m["destination"]),
            options=tuple(m.get("options") or ()),
            type=m.get("type") or None,
        )
        for m in oci.get("mounts") or ()
    ]
    rules = [
        DeviceRule(
            allow=bool(r.get("allow")),
            type=str(r.get("type") or "a"),
            major=r.get("major"),
            minor=r.get("minor"),
            access=str(r.get("access") or "rwm"),
        )
        for r in (linux.get("resources") or {}).get("devices") or ()
    ]
    return Edits(
        env=_merge_env((), (oci.get("process") or {}).get("env") or ()),
        device_nodes=tuple(nodes),
        mounts=tuple(mounts),
        device_rules=tuple(rules),
    )


# --------------------------------------------------------------------------- the host's driver files


def _ldconfig_paths() -> list[str]:
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None
    )
    if ldconfig is None:
        return []
    try:
        out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.rsplit("=>", 1)[1].strip() for line in out.splitlines() if "=>" in line]


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def host_driver_file_dirs(
    hide: Iterable[str] = (),
    pattern: str = DRIVER_FILE_PATTERN,
    extra_dirs: Iterable[str] = (),
) -> tuple[str, ...]:
    """Directories (real paths) outside `hide` that hold NVIDIA driver files the loader or
    a shell could find: those in ld.so.cache, on PATH and LD_LIBRARY_PATH, the usual
    library and tool directories, and `extra_dirs`."""
    rx = re.compile(pattern)
    hidden = [os.path.realpath(h) for h in hide]
    candidates: set[str] = set()
    for lib in _ldconfig_paths():
        if rx.match(os.path.basename(lib)):
            candidates.add(os.path.dirname(lib))
            candidates.add(os.path.dirname(os.path.realpath(lib)))
    search = [
        *os.environ.get("PATH", DEFAULT_PATH).split(":"),
        *os.environ.get("LD_LIBRARY_PATH", "").split(":"),
        *DEFAULT_PATH.split(":"),
        "/lib",
        "/lib64",
        "/usr/lib",
        "/usr/lib64",
        "/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
        "/lib/aarch64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        *extra_dirs,
    ]
    candidates.update(d for d in search if d)
    dirs = set()
    for d in candidates:
        real = os.path.realpath(d)
        if not os.path.isdir(real) or _under(real, hidden):
            continue
        try:
            names = os.listdir(real)
        except OSError:
            continue
        if any(rx.match(n) for n in names):
            dirs.add(real)
    return tuple(sorted(dirs))


# --------------------------------------------------------------------------- running


@dataclass(frozen=True)
class ContainerOptions:
    user: int | None = NOBODY  # None: stay root (then only the device cgroup isolates)
    group: int = NOBODY
    hide: tuple[str, ...] = ()  # replaced by an empty tmpfs (e.g. the driver root)
    tmp_dirs: tuple[str, ...] = ("/tmp",)  # replaced by an empty, world-writable tmpfs
    mask_dirs: tuple[str, ...] = ()  # driver files matching mask_pattern disappear from these
    mask_pattern: str = DRIVER_FILE_PATTERN
    base_env: tuple[str, ...] = (f"PATH={DEFAULT_PATH}", "HOME=/tmp", "LANG=C.UTF-8")
    device_cgroup: bool = True  # filter devices with a cgroup v2 BPF program where possible
    require_device_cgroup: bool = False
    cwd: str = "/"


@dataclass
class ContainerResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    setup: dict[str, Any] = field(default_factory=dict)  # the init's report: masks, cgroup, warnings

    def describe(self) -> str:
        """The command and its output, for logs and result files."""
        return f"$ {' '.join(self.argv)}\n(exit {self.returncode})\n{self.stdout}" + (
            f"--- stderr ---\n{self.stderr}" if self.stderr.strip() else ""
        )


def run_container(
    edits: Edits,
    argv: Sequence[str],
    options: ContainerOptions | None = None,
    *,
    timeout: float = 300.0,
    python: str | None = None,
) -> ContainerResult:
    """Run `argv` in a container with `edits` applied (see the module docstring); root only."""
    opts = options or ContainerOptions()
    if os.geteuid() != 0:
        raise ContainerError("run_container needs root (namespaces, mknod, mounts)")
    unshare = shutil.which("unshare")
    if unshare is None:
        raise ContainerError("util-linux unshare is not installed")
    with tempfile.TemporaryDirectory(prefix="dra-container-") as tmp:
        report_path = os.path.join(tmp, "report.json")
        plan = {
            "edits": asdict(edits),
            "argv": list(argv),
            "env": list(_merge_env(opts.base_env, edits.env)),
            "options": asdict(opts),
            "report": report_path,
        }
        plan_path = os.path.join(tmp, "plan.json")
        Path(plan_path).write_text(json.dumps(plan))
        cmd = [
            unshare,
            "--mount",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "--propagation",
            "private",
            python or sys.executable,
            "-I",
            os.path.abspath(__file__),
            "--init",
            plan_path,
        ]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err += f"\n[container killed after {timeout:.0f}s]".encode()
        try:
            setup = json.loads(Path(report_path).read_text())
        except (OSError, ValueError):
            setup = {}
        cgroup = setup.get("device_cgroup", {}).get("path")
        if cgroup:
            _remove_cgroup(cgroup)
        return ContainerResult(
            tuple(argv), proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"), setup
        )


def _remove_cgroup(path: str) -> None:
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)  # retry back-off: the cgroup empties as its last process is reaped


# =========================================================================== init (inside the namespaces)

MS_RDONLY: Final = 0x1
MS_NOSUID: Final = 0x2
MS_NODEV: Final = 0x4
MS_NOEXEC: Final = 0x8
MS_REMOUNT: Final = 0x20
MS_BIND: Final = 0x1000
MS_REC: Final = 0x4000
MNT_DETACH: Final = 0x2
PR_SET_NO_NEW_PRIVS: Final = 38

_MOUNT_FLAGS: Final = {
    "ro": MS_RDONLY,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "rw": 0,
    "bind": 0,
    "rbind": 0,
    "suid": 0,
    "dev": 0,
    "exec": 0,
}

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if (
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        )
        != 0
    ):
        e = ctypes.get_errno()
        raise OSError(e, f"mount({source!r}, {target!r}, {fstype!r}, {flags:#x}, {data!r}): {os.strerror(e)}")


def _umount(target: str) -> None:
    if _libc.umount2(target.encode(), MNT_DETACH) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount({target!r}): {os.strerror(e)}")


class _Rootfs:
    """Changes the namespace's view of the host's filesystem without writing to it."""

    STAGING = "/dev/.container-staging"

    def __init__(self, report: dict[str, Any]) -> None:
        self.owned: set[str] = set()  # directories whose entries are ours to create
        self.pinned: list[str] = []
        self.report = report
        report.setdefault("masked", [])
        report.setdefault("shadowed", [])
        report.setdefault("warnings", [])

    def tmpfs(self, path: str, mode: int, flags: int = MS_NOSUID | MS_NODEV) -> None:
        _mount("tmpfs", path, "tmpfs", flags, f"mode={mode:o}")
        self.owned.add(os.path.realpath(path))

    def shadow(self, directory: str, exclude: re.Pattern[str] | None = None) -> str:
        """Replace `directory` by a tmpfs of bind mounts of its entries (minus `exclude`)."""
        real = os.path.realpath(directory)
        if real in self.owned:
            return real
        st = os.stat(real)
        orig = os.path.join(self.STAGING, secrets.token_hex(6))
        os.makedirs(orig)
        _mount(real, orig, None, MS_BIND | MS_REC)
        _mount(
            "tmpfs",
            real,
            "tmpfs",
            MS_NOSUID,
            f"mode={stat.S_IMODE(st.st_mode):o},uid={st.st_uid},gid={st.st_gid}",
        )
        for name in sorted(os.listdir(orig)):
            src, dst = os.path.join(orig, name), os.path.join(real, name)
            if exclude is not None and exclude.match(name):
                self.report["masked"].append(dst)
                continue
            lst = os.lstat(src)
            if stat.S_ISLNK(lst.st_mode):
                os.symlink(os.readlink(src), dst)
            elif stat.S_ISDIR(lst.st_mode):
                os.mkdir(dst)
                _mount(src, dst, None, MS_BIND | MS_REC)
            else:
                Path(dst).touch()
                _mount(src, dst, None, MS_BIND)
        _umount(orig)
        os.rmdir(orig)
        self.owned.add(real)
        self.report["shadowed"].append(real)
        return real

    def pin(self, source: str) -> str:
        """A bind mount of `source` under the staging directory, which hiding cannot reach."""
        if not os.path.exists(source):
            raise ContainerError(f"mount source {source} does not exist")
        pinned = os.path.join(self.STAGING, f"pin-{secrets.token_hex(6)}")
        if os.path.isdir(source):
            os.mkdir(pinned)
            _mount(source, pinned, None, MS_BIND | MS_REC)
        else:
            Path(pinned).touch()
            _mount(source, pinned, None, MS_BIND)
        self.pinned.append(pinned)
        return pinned

    def unpin_all(self) -> None:
        for p in self.pinned:
            _umount(p)
            if os.path.isdir(p):
                os.rmdir(p)
            else:
                os.unlink(p)
        os.rmdir(self.STAGING)

    def ensure_dir(self, path: str) -> str:
        """A directory at `path` that this namespace may add entries to; returns its real path."""
        path = os.path.normpath(path)
        if os.path.lexists(path):
            real = os.path.realpath(path)
            if not os.path.isdir(real):
                raise ContainerError(f"{path} is not a directory")
            return real if real in self.owned else self.shadow(real)
        parent = self.ensure_dir(os.path.dirname(path))
        real = os.path.join(parent, os.path.basename(path))
        os.mkdir(real, 0o755)
        self.owned.add(real)
        return real

    def mount_point(self, destination: str, is_dir: bool) -> str:
        parent = self.ensure_dir(os.path.dirname(os.path.normpath(destination)))
        target = os.path.join(parent, os.path.basename(os.path.normpath(destination)))
        if os.path.islink(target):
            os.unlink(target)  # a link in a directory of ours: the mount replaces it
        if not os.path.lexists(target):
            if is_dir:
                os.mkdir(target, 0o755)
            else:
                Path(target).touch()
        return target


def _setup_dev(fs: _Rootfs, report: dict[str, Any]) -> None:
    fs.tmpfs("/dev", 0o755, MS_NOSUID)  # device nodes must work here: no nodev
    os.makedirs(_Rootfs.STAGING)
    for path, major, minor in ORDINARY_DEVICES:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    os.mkdir("/dev/shm", 0o1777)
    _mount("shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    os.mkdir("/dev/pts", 0o755)
    try:
        _mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
        os.symlink("pts/ptmx", "/dev/ptmx")
    except OSError as e:
        report["warnings"].append(f"no /dev/pts: {e}")
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"/dev/{name}")


def _create_node(fs: _Rootfs, node: Mapping[str, Any]) -> None:
    path = str(node["path"])
    parent = fs.ensure_dir(os.path.dirname(path))
    target = os.path.join(parent, os.path.basename(path))
    if os.path.lexists(target):
        os.unlink(target)
    kind = stat.S_IFBLK if node["type"] == "b" else stat.S_IFCHR
    os.mknod(target, int(node["file_mode"]) | kind, os.makedev(int(node["major"]), int(node["minor"])))
    os.chmod(target, int(node["file_mode"]))
    os.chown(target, int(node["uid"]), int(node["gid"]))


def _is_bind(m: Mapping[str, Any]) -> bool:
    return m["type"] in (None, "", "bind", "none") or "bind" in m["options"] or "rbind" in m["options"]


def _apply_mount(fs: _Rootfs, m: Mapping[str, Any]) -> None:
    options = list(m["options"])
    flags = 0
    data = []
    for o in options:
        if o in _MOUNT_FLAGS:
            flags |= _MOUNT_FLAGS[o]
        else:
            data.append(o)
    kind = m["type"]
    if _is_bind(m):
        source = str(m["source"])
        if not os.path.exists(source):
            raise ContainerError(f"mount source {source} does not exist")
        target = fs.mount_point(str(m["destination"]), os.path.isdir(source))
        _mount(source, target, None, MS_BIND | (MS_REC if "rbind" in options else 0))
        if flags:
            _mount("", target, None, MS_REMOUNT | MS_BIND | flags)
    else:
        target = fs.mount_point(str(m["destination"]), True)
        _mount(str(m["source"] or kind), target, kind, flags, ",".join(data) or None)


# -- cgroup v2 device filter (BPF_PROG_TYPE_CGROUP_DEVICE) ------------------------------

_SYS_BPF: Final = {"x86_64": 321, "aarch64": 280}
_BPF_PROG_LOAD: Final = 5
_BPF_PROG_ATTACH: Final = 8
_BPF_PROG_TYPE_CGROUP_DEVICE: Final = 15
_BPF_CGROUP_DEVICE: Final = 6
_BPF_F_ALLOW_MULTI: Final = 2
_DEV_TYPE: Final = {"b": 1, "c": 2}
_DEV_ACCESS: Final = {"m": 1, "r": 2, "w": 4}


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


_LDX_W, _AND_K, _RSH_K, _MOV_K, _MOV_X, _JNE_K, _EXIT = 0x61, 0x57, 0x77, 0xB7, 0xBF, 0x55, 0x95


def device_filter_program(rules: Sequence[DeviceRule]) -> bytes:
    """BPF instructions that allow a device access iff an allow rule matches it (deny rules
    are not supported: the default is deny). Same shape as runc's devicefilter."""
    prog = [
        _insn(_LDX_W, dst=2, src=1, off=0),  # r2 = ctx->access_type
        _insn(_AND_K, dst=2, imm=0xFFFF),  # r2 = device type
        _insn(_LDX_W, dst=3, src=1, off=0),
        _insn(_RSH_K, dst=3, imm=16),  # r3 = requested access
        _insn(_LDX_W, dst=4, src=1, off=4),  # r4 = major
        _insn(_LDX_W, dst=5, src=1, off=8),  # r5 = minor
    ]
    for rule in rules:
        if not rule.allow:
            raise ContainerError(f"deny rules are not supported by this device filter: {rule}")
        checks: list[tuple[bytes, ...]] = []
        if rule.type != "a":
            checks.append((_insn(_JNE_K, dst=2, imm=_DEV_TYPE[rule.type]),))
        allowed = sum(_DEV_ACCESS[c] for c in set(rule.access))
        if allowed != 7:
            checks.append(
                (
                    _insn(_MOV_X, dst=1, src=3),
                    _insn(_AND_K, dst=1, imm=~allowed & 7),
                    _insn(_JNE_K, dst=1, imm=0),
                )
            )
        if rule.major is not None:
            checks.append((_insn(_JNE_K, dst=4, imm=rule.major),))
        if rule.minor is not None:
            checks.append((_insn(_JNE_K, dst=5, imm=rule.minor),))
        block = [i for c in checks for i in c] + [_insn(_MOV_K, dst=0, imm=1), _insn(_EXIT)]
        # every jump of the block skips to its end
        fixed = []
        for n, ins in enumerate(block):
            if ins[0] == _JNE_K:
                code, regs, _, imm = struct.unpack("<BBhi", ins)
                ins = struct.pack("<BBhi", code, regs, len(block) - n - 1, imm)
            fixed.append(ins)
        prog.extend(fixed)
    prog += [_insn(_MOV_K, dst=0, imm=0), _insn(_EXIT)]
    return b"".join(prog)


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    nr = _SYS_BPF.get(os.uname().machine)
    if nr is None:
        raise OSError(0, f"bpf syscall number unknown on {os.uname().machine}")
    ret = int(_libc.syscall(ctypes.c_long(nr), ctypes.c_int(cmd), attr, ctypes.c_uint(len(attr))))
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret


def _cgroup2_mount() -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[0] == "cgroup2":
                return left.split()[4]
    return None


def apply_device_cgroup(rules: Sequence[DeviceRule]) -> str:
    """Move this process into a new cgroup v2 child whose BPF device program allows only
    `rules`; returns the cgroup's path."""
    mnt = _cgroup2_mount()
    if mnt is None:
        raise OSError(0, "no cgroup2 file system is mounted")
    current = "/"
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                current = line[3:].strip()
    path = os.path.join(mnt, current.lstrip("/"), f"dra-container-{secrets.token_hex(4)}")
    os.mkdir(path)
    try:
        code = device_filter_program(rules)
        insns = ctypes.create_string_buffer(code, len(code))
        license_ = ctypes.create_string_buffer(b"GPL")
        log_buf = ctypes.create_string_buffer(65536)
        attr = ctypes.create_string_buffer(144)
        struct.pack_into(
            "<IIQQIIQ",
            attr,
            0,
            _BPF_PROG_TYPE_CGROUP_DEVICE,
            len(code) // 8,
            ctypes.addressof(insns),
            ctypes.addressof(license_),
            1,
            len(log_buf),
            ctypes.addressof(log_buf),
        )
        struct.pack_into("<I", attr, 68, _BPF_CGROUP_DEVICE)  # expected_attach_type
        try:
            prog_fd = _bpf(_BPF_PROG_LOAD, attr)
        except OSError as e:
            raise OSError(
                e.errno, f"loading the device program: {e.strerror}; {log_buf.value.decode()[-500:]}"
            ) from e
        cg_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            attach = ctypes.create_string_buffer(144)
            struct.pack_into("<IIII", attach, 0, cg_fd, prog_fd, _BPF_CGROUP_DEVICE, _BPF_F_ALLOW_MULTI)
            _bpf(_BPF_PROG_ATTACH, attach)
        finally:
            os.close(cg_fd)
            os.close(prog_fd)
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write("0")
    except BaseException:
        os.rmdir(path)
        raise
    return path


def ordinary_device_rules() -> tuple[DeviceRule, ...]:
    """What runc allows every container: mknod of anything, the ordinary nodes, ptys."""
    return (
        DeviceRule(True, "c", None, None, "m"),
        DeviceRule(True, "b", None, None, "m"),
        *(DeviceRule(True, "c", major, minor, "rwm") for _, major, minor in ORDINARY_DEVICES),
        DeviceRule(True, "c", 5, 1, "rwm"),  # console
        DeviceRule(True, "c", 5, 2, "rwm"),  # ptmx
        DeviceRule(True, "c", 136, None, "rwm"),  # pts
    )


def _init(plan_path: str) -> int:
    """PID 1 of the container: set the namespace up, then run and reap the workload."""
    plan = json.loads(Path(plan_path).read_text())
    report: dict[str, Any] = {"warnings": []}
    report_file = open(plan["report"], "w")  # opened now: /tmp may be hidden below  # noqa: SIM115
    os.umask(0)
    opts = plan["options"]
    edits = plan["edits"]
    fs = _Rootfs(report)
    _setup_dev(fs, report)
    # Mount sources are resolved on the host, as a runtime does; pin them before any of
    # them is hidden or masked below.
    mounts = [{**m, "source": fs.pin(str(m["source"]))} if _is_bind(m) else m for m in edits["mounts"]]
    exclude = re.compile(opts["mask_pattern"])
    for d in opts["mask_dirs"]:
        if os.path.isdir(d):
            fs.shadow(d, exclude)
    for d in opts["hide"]:
        if os.path.isdir(d):
            fs.tmpfs(d, 0o755)
    for d in opts["tmp_dirs"]:
        if os.path.isdir(d):
            fs.tmpfs(d, 0o1777)
    for node in edits["device_nodes"]:
        _create_node(fs, node)
    for m in mounts:
        _apply_mount(fs, m)
    fs.unpin_all()
    report["device_cgroup"] = {"path": None}
    if opts["device_cgroup"]:
        rules = [*ordinary_device_rules(), *(DeviceRule(**r) for r in edits["device_rules"])]
        try:
            report["device_cgroup"] = {"path": apply_device_cgroup(rules), "rules": len(rules)}
        except OSError as e:
            report["device_cgroup"] = {"path": None, "error": str(e)}
            if opts["require_device_cgroup"]:
                raise
    json.dump(report, report_file)
    report_file.close()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(opts["cwd"])
            if opts["user"] is not None:
                os.setgroups([])
                os.setgid(int(opts["group"]))
                os.setuid(int(opts["user"]))
            _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            env = dict(e.split("=", 1) for e in plan["env"])
            os.execvpe(plan["argv"][0], plan["argv"], env)
        except BaseException:
            traceback.print_exc()
            os._exit(127)
    while True:
        try:
            reaped, status = os.wait()
        except ChildProcessError:
            return 125
        if reaped == pid:
            code = os.waitstatus_to_exitcode(status)
            return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as shells say


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--init":
    try:
        code = _init(sys.argv[2])
    except Exception:
        traceback.print_exc()
        code = 125
    sys.exit(code)
