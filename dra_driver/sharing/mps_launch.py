"""The launcher between the kubelet plugin and one claim's `nvidia-cuda-mps-control -d`.

Run as `python -m dra_driver.sharing.mps_launch [--join-cgroups-of PID] [--shm DIR] -- CMD...`;
it changes where the process lives, then execs CMD, so that everything the control daemon
forks (itself, its MPS servers) inherits it:

- `--join-cgroups-of 1` moves it into the cgroups of PID 1 in every hierarchy. With the
  plugin pod on the host's PID namespace (the chart's `hostPID: true`), PID 1 is the host's
  init, outside every pod: the runtime ends a stopped container by signalling every process
  of the container's cgroup, so a daemon left there dies with the plugin at each upgrade,
  crash or uninstall. Outside it, the daemon lives from its claim's Prepare to its Unprepare.
  It first enters PID 1's cgroup namespace, so that `/proc/1/cgroup` names absolute paths,
  and writes through `/proc/1/root` (the host's view of its cgroup mounts).
- `--shm DIR` gives it a mount namespace of its own with DIR (the claim's shm tmpfs) over
  `/dev/shm`: MPS clients and servers share memory there, and the claim's containers get
  the same tmpfs as their `/dev/shm`.

The mount and namespace calls are `dra_driver.sharing.mounts`'s, the plugin's own (libc via
ctypes). `cgroup_targets` is pure. It must not start anything but CMD, nor touch another
process's cgroups.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import PurePosixPath

from dra_driver.sharing import mounts


def cgroup_targets(cgroup: str, mountinfo: str) -> list[PurePosixPath]:
    """The `cgroup.procs` files (as mount points in that process's mount namespace) of the
    cgroups a process is in, from its `/proc/<pid>/cgroup` and `/proc/<pid>/mountinfo`."""
    paths: dict[frozenset[str], str] = {}
    for line in cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            paths[frozenset(c for c in parts[1].split(",") if c)] = parts[2]
    targets: list[PurePosixPath] = []
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        root, mount_point = fields[3], fields[4]
        if tail[0] == "cgroup2":
            key: frozenset[str] = frozenset()
        else:
            opts = set(tail[2].split(","))
            found = next((k for k in paths if k and k <= opts), None)
            if found is None:
                continue
            key = found
        path = paths.get(key)
        if path is None:
            continue
        rel = PurePosixPath(path).relative_to(root) if PurePosixPath(path).is_relative_to(root) else None
        if rel is None:  # a mount of another part of the hierarchy
            continue
        targets.append(PurePosixPath(mount_point) / rel / "cgroup.procs")
    return targets


def join_cgroups_of(pid: int) -> None:
    mounts.enter_cgroup_namespace_of(pid)
    with open(f"/proc/{pid}/cgroup") as f:
        cgroup = f.read()
    with open(f"/proc/{pid}/mountinfo") as f:
        mountinfo = f.read()
    targets = cgroup_targets(cgroup, mountinfo)
    if not targets:
        raise OSError(f"no cgroup mount of PID {pid} found in its mountinfo")
    for target in targets:
        with open(f"/proc/{pid}/root{target}", "w") as f:
            f.write(str(os.getpid()))


def private_shm(shm: str) -> None:
    mounts.private_mount_namespace()
    mounts.bind_mount(shm, "/dev/shm")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mps_launch")
    parser.add_argument("--join-cgroups-of", type=int)
    parser.add_argument("--shm")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command")
    try:
        if args.join_cgroups_of is not None:
            join_cgroups_of(args.join_cgroups_of)
        if args.shm:
            private_shm(args.shm)
    except OSError as e:
        print(f"mps_launch: {e}", file=sys.stderr)
        sys.exit(2)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
