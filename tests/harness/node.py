"""Real Kubernetes nodes on this machine: containerd + runc + the kubelet, for the node tier.

`Nodes.start(cp, specs)` brings up one node per `NodeSpec` against a running
`tests.harness.cluster.ControlPlane` and runs `dra-driver kubelet-plugin --simulate
<profile>` for each, the way users run it (the node's kubelet dir and CDI dir). Per node:

* a *sandbox*: `unshare --mount --pid --fork --mount-proc --kill-child` with a small
  init as PID 1 and private tmpfs over /run, /var/lib and /var/log. containerd and the
  kubelet are started inside it (`nsenter`), so the kubelet's fixed paths
  (/var/lib/kubelet/device-plugins, /var/log/containers) and containerd's
  (/run/containerd/{s,fifo,runc}, the NRI socket) are per node, and everything the node
  starts (shims, pause and test containers, their mounts) lives in the sandbox's PID
  and mount namespaces: when the sandbox goes, the kernel kills all of it and drops
  the mounts. The sandbox dies with this process (`setpriv --pdeathsig KILL` on `unshare`,
  `--kill-child` on its init), so a SIGKILLed pytest leaves no process and no mount;
* a node IP: a veth pair with a /32 address on one end (the kubelet refuses loopback);
* containerd 2.4 with its own root, state, socket, a CNI bridge of its own, the
  driver's CDI dir as `cdi_spec_dirs`, and the offline images of tests.harness.images;
* the kubelet, authenticated as `system:node:<name>` by a static token (the control
  plane must be started with `node_tokens(...)`), serving on the node IP.

What the kernel does not undo by itself (the veth and bridge links, the sysctls the
kubelet sets, the cgroups runc made) is undone by a *reaper*: a process of its own
session that waits for this process to close a pipe (or die), then restores everything
recorded in the state file. Normal teardown goes the same way, so there is one cleanup
path. The pods' veths are deleted by the reaper too (the ports of the node's bridge), not
left to their network namespaces: a namespace can outlive its sandbox (tests.harness.host_links
says why). `Nodes.stop` then raises `LinksLeftBehind` if a link it made or saw on its
bridges is still there. Every process is stopped by its PID, never by name. Where root lacks
CAP_SYS_RESOURCE (containers in this sandboxed VM) containerd gets
`restrict_oom_score_adj = true`, and a log line says so.

This module starts and stops nodes; it asserts nothing about the driver (tests/node does)
and never touches an address outside loopback and its own veth and bridge.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from kubernetes import client

from tests.harness.cluster import REPO_ROOT, ControlPlane, free_port, pid_alive
from tests.harness.driver import DriverProcess, with_parent_death_signal
from tests.harness.host_links import LinksLeftBehind, bridge_ports, link_names, links_left_behind
from tests.harness.images import PAUSE_IMAGE, write_test_images
from tests.harness.objects import sync_client, sync_request

logger = structlog.get_logger(__name__)

BUILD_SCRIPT = REPO_ROOT / "hack" / "node" / "build.sh"
SETUP_SCRIPT = REPO_ROOT / "hack" / "node" / "setup.sh"
# Debian's paths (hack/node/setup.sh); a host without those packages points elsewhere
# (hack/h200/run.sh carries its own runc and CNI plugins to the GPU host).
RUNC = Path(os.environ.get("DRA_NODE_RUNC", "/usr/sbin/runc"))
CNI_BIN = Path(os.environ.get("DRA_NODE_CNI_BIN", "/usr/lib/cni"))
# `native` (copies, slow) where the kernel has no overlayfs.
SNAPSHOTTER = os.environ.get("DRA_NODE_SNAPSHOTTER", "overlayfs")
# Kernels without veth: the node IP as a /32 on `lo` (not a loopback address to the kubelet).
NODE_IP_ON_LO = os.environ.get("DRA_NODE_IP_ON_LO") == "1"
CAP_SYS_RESOURCE = 24

# What the kubelet writes at start (setupKernelTunables), and what a CNI bridge may turn on.
SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",
)

# PID 1 of a node sandbox: reaps orphans (shims re-parent to it) and sleeps.
_INIT = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: os._exit(0))\n"
    "while True:\n"
    "    try:\n"
    "        os.wait()\n"
    "    except ChildProcessError:\n"
    "        time.sleep(0.5)\n"  # not a wait: no child to reap yet
)


def build_node_binaries() -> Path:
    """Install the Debian packages and build (or reuse) kubelet and containerd; returns the binary dir."""
    override = os.environ.get("DRA_NODE_BIN")
    if override:
        return Path(override)
    subprocess.run(["bash", str(SETUP_SCRIPT)], check=True, stdin=subprocess.DEVNULL)
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"node build failed (exit {proc.returncode}); see the log above")
    return Path(proc.stdout.strip().splitlines()[-1])


def node_token(name: str) -> str:
    return "node-" + hashlib.sha256(name.encode()).hexdigest()[:24]


def node_tokens(names: Sequence[str]) -> list[tuple[str, str, str]]:
    """Static (token, user, groups) rows for `ControlPlane.start(extra_tokens=...)`: one kubelet each."""
    return [(node_token(n), f"system:node:{n}", "system:nodes") for n in names]


def has_cap_sys_resource() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


def parent_pids() -> dict[int, int]:
    """Every process (host view) -> its parent, from one scan of /proc."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        # The comm field may hold spaces or parentheses: split after the last ')'.
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def child_pids(pid: int) -> list[int]:
    """PIDs (host view) whose parent is `pid`."""
    return sorted(p for p, parent in parent_pids().items() if parent == pid)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (host view), parents before children."""
    children: dict[int, list[int]] = {}
    for p, parent in parent_pids().items():
        children.setdefault(parent, []).append(p)
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _free_subnet(seed: int) -> int:
    """The second octet (200-249) for a run's node and pod addresses that no address or route
    on this host uses yet. Node clusters of one test session can be alive at once (a
    session-scoped one beside a test's own): picking by hash alone, two of them met on the
    same node IP 1 time in 50 ("bind: address already in use" from the second kubelet)."""
    shown = _ip("-4", "-o", "addr", "show", check=False).stdout
    shown += _ip("-4", "route", "show", check=False).stdout
    used = {int(m) for m in re.findall(r"\b10\.(2[0-4]\d)\.", shown)}
    for step in range(50):
        subnet = 200 + (seed + step) % 50
        if subnet not in used:
            return subnet
    raise RuntimeError(f"every node subnet 10.200-249.x.x is in use on this host: {sorted(used)}")


@dataclass(frozen=True)
class NodeSpec:
    name: str
    profile: str  # `dra-driver inventory --list-profiles`; "" for the real GPUs (NVML)
    driver_args: tuple[str, ...] = ()  # more `dra-driver kubelet-plugin` flags, e.g. --driver-root


@dataclass
class _Launched:
    """A process started inside a node sandbox with nsenter; `pid` is its host PID."""

    name: str
    argv: list[str]
    nsenter: subprocess.Popen[bytes]
    pid: int


@dataclass
class Node:
    """One real node. Made by `Nodes.start`."""

    spec: NodeSpec
    index: int
    dir: Path
    bin_dir: Path
    subnet: int  # the second octet of this run's addresses
    cp: ControlPlane
    link: str
    bridge: str
    restrict_oom: bool
    sandbox: subprocess.Popen[bytes] | None = None
    init_pid: int = 0
    containerd: _Launched | None = None
    kubelet: _Launched | None = None
    driver: DriverProcess | None = None
    port: int = 10250
    healthz_port: int = 0
    # The driver comes as a DaemonSet pod (tests/node/test_helm.py): the kubelet's root and the
    # CDI dir at their usual paths inside the sandbox, and pods routed to this machine (the API).
    daemonset: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ip(self) -> str:
        return f"10.{self.subnet}.{self.index}.1"

    @property
    def pod_subnet(self) -> str:
        return f"10.{self.subnet}.{100 + self.index}.0/24"

    @property
    def kubelet_dir(self) -> Path:
        return Path("/var/lib/kubelet") if self.daemonset else self.dir / "kubelet"

    @property
    def cdi_dir(self) -> Path:
        return Path("/var/run/cdi") if self.daemonset else self.dir / "cdi"

    def host_path(self, path: Path) -> Path:
        """`path` as seen inside this node's sandbox, from outside it (symlinks such as
        /var/run -> /run resolved against the sandbox's root, not this process's)."""
        if not self.daemonset:
            return path
        root = Path(f"/proc/{self.init_pid}/root")
        inside = Path("/")
        for part in path.relative_to("/").parts:
            here = root / (inside / part).relative_to("/")
            target = Path(os.readlink(here)) if here.is_symlink() else None
            inside = (target if target.is_absolute() else inside / target) if target else inside / part
        return root / inside.relative_to("/")

    @property
    def containerd_socket(self) -> Path:
        return self.dir / "containerd.sock"

    @property
    def pod_logs_dir(self) -> Path:
        return self.dir / "pod-logs"

    # -- sandbox -------------------------------------------------------------------------------

    def start_sandbox(self) -> None:
        setup = " && ".join(
            [
                "mount -t tmpfs -o mode=0755 node-run /run",
                # shared, as / is on a systemd host: the chart's MPS root is a Bidirectional mount
                "mount --make-rshared /run",
                "mount -t tmpfs -o mode=0755 node-var-lib /var/lib",
                "mkdir -p /var/lib/kubelet /run/cdi",
                "mount -t tmpfs -o mode=0755 node-var-log /var/log",
                f"exec {sys.executable} -c '{_INIT}' {self.dir}",
            ]
        )
        argv = [
            "unshare",
            "--mount",
            "--pid",
            "--fork",
            "--mount-proc",
            "--propagation",
            "private",
            "--kill-child",
            "--",
            "/bin/sh",
            "-c",
            setup,
        ]
        out = open(self.dir / "sandbox.log", "ab")  # noqa: SIM115 - owned by the child
        self.sandbox = subprocess.Popen(
            with_parent_death_signal(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.sandbox.poll() is not None:
                raise RuntimeError(f"sandbox of {self.name} exited: {self._tail('sandbox.log')}")
            kids = child_pids(self.sandbox.pid)
            if kids and str(self.dir) in _cmdline(kids[0]) and sys.executable in _cmdline(kids[0]):
                self.init_pid = kids[0]
                return
            time.sleep(0.05)  # the poll interval
        raise TimeoutError(f"sandbox of {self.name} did not start: {self._tail('sandbox.log')}")

    def _launch(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> _Launched:
        out = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        full = ["nsenter", "--target", str(self.init_pid), "--mount", "--pid", "--", *argv]
        proc = subprocess.Popen(
            with_parent_death_signal(full),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.dir,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        out.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            kids = child_pids(proc.pid)
            if kids:
                return _Launched(name, argv, proc, kids[0])
            if proc.poll() is not None:
                raise RuntimeError(f"{name} of {self.name} exited at once: {self._tail(f'{name}.log')}")
            time.sleep(0.02)  # the poll interval
        raise TimeoutError(f"{name} of {self.name}: nsenter started no child")

    def _stop(self, launched: _Launched | None, sig: int = signal.SIGTERM, grace: float = 15.0) -> None:
        if launched is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(launched.pid, sig)
        try:
            launched.nsenter.wait(grace)
        except subprocess.TimeoutExpired:
            logger.warning(
                "process ignored its signal; killing", node=self.name, process=launched.name, pid=launched.pid
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(launched.pid, signal.SIGKILL)
            launched.nsenter.wait(10)

    def _tail(self, log: str, size: int = 3000) -> str:
        path = self.dir / log
        return path.read_text(errors="replace")[-size:] if path.exists() else ""

    # -- network -------------------------------------------------------------------------------

    def add_node_ip(self) -> None:
        if NODE_IP_ON_LO:
            _ip("addr", "add", f"{self.ip}/32", "dev", "lo")
            return
        _ip("link", "add", self.link, "type", "veth", "peer", "name", self.link + "p")
        _ip("addr", "add", f"{self.ip}/32", "dev", self.link)
        _ip("link", "set", self.link, "up")
        _ip("link", "set", self.link + "p", "up")

    def write_cni_config(self) -> None:
        conf_dir = self.dir / "cni" / "conf"
        conf_dir.mkdir(parents=True, exist_ok=True)
        conflist = {
            "cniVersion": "1.0.0",
            "name": f"dra-{self.name}",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": self.daemonset,
                    "isDefaultGateway": self.daemonset,
                    "ipMasq": False,
                    "hairpinMode": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.pod_subnet}]],
                        "dataDir": str(self.dir / "cni" / "ipam"),
                    },
                }
            ],
        }
        (conf_dir / "10-bridge.conflist").write_text(json.dumps(conflist, indent=2))

    # -- containerd ----------------------------------------------------------------------------

    def containerd_config(self) -> str:
        cri_images = "plugins.'io.containerd.cri.v1.images'"
        runtime = "plugins.'io.containerd.cri.v1.runtime'"
        runc = f"{runtime}.containerd.runtimes.runc"
        return "\n".join(
            [
                "version = 3",
                f"root = '{self.dir / 'containerd' / 'root'}'",
                f"state = '{self.dir / 'containerd' / 'state'}'",
                "[grpc]",
                f"  address = '{self.containerd_socket}'",
                "[ttrpc]",
                f"  address = '{self.containerd_socket}.ttrpc'",
                f"[{cri_images}]",
                f"  snapshotter = '{SNAPSHOTTER}'",
                f"[{cri_images}.pinned_images]",
                f"  sandbox = '{PAUSE_IMAGE}'",
                f"[{runtime}]",
                f"  cdi_spec_dirs = ['{self.cdi_dir}']",
                "  netns_mounts_under_state_dir = true",
                f"  restrict_oom_score_adj = {'true' if self.restrict_oom else 'false'}",
                f"[{runtime}.containerd]",
                "  default_runtime_name = 'runc'",
                f"[{runc}]",
                "  runtime_type = 'io.containerd.runc.v2'",
                f"[{runc}.options]",
                "  SystemdCgroup = false",
                f"  BinaryName = '{RUNC}'",
                f"[{runtime}.cni]",
                f"  bin_dirs = ['{CNI_BIN}']",
                f"  conf_dir = '{self.dir / 'cni' / 'conf'}'",
                "[plugins.'io.containerd.grpc.v1.cri']",
                "  stream_server_address = '127.0.0.1'",
                "  stream_server_port = '0'",
                "",
            ]
        )

    def start_containerd(self) -> None:
        config = self.dir / "containerd.toml"
        config.write_text(self.containerd_config())
        env = {"PATH": f"{self.bin_dir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}
        self.containerd = self._launch(
            "containerd", [str(self.bin_dir / "containerd"), "--config", str(config)], env
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.containerd.nsenter.poll() is not None:
                raise RuntimeError(f"containerd of {self.name} exited: {self._tail('containerd.log')}")
            if self.ctr("version", check=False).returncode == 0:
                return
            time.sleep(0.1)  # the poll interval
        raise TimeoutError(f"containerd of {self.name} not serving: {self._tail('containerd.log')}")

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                str(self.bin_dir / "ctr"),
                "--address",
                str(self.containerd_socket),
                "--namespace",
                "k8s.io",
                *args,
            ],
            capture_output=True,
            text=True,
            check=check,
        )

    def import_images(self, archives: dict[str, Path]) -> None:
        for name, archive in archives.items():
            label = ["--label", "io.cri-containerd.pinned=pinned"] if name == PAUSE_IMAGE else []
            proc = self.ctr("images", "import", *label, str(archive), check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"ctr images import {archive.name} on {self.name}: {proc.stderr.strip()}")

    def task_pids(self) -> dict[str, int]:
        """containerd container id -> host PID of its task (from `ctr tasks ls`)."""
        out = self.ctr("tasks", "ls").stdout.splitlines()[1:]
        tasks: dict[str, int] = {}
        for line in out:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "RUNNING":
                tasks[parts[0]] = int(parts[1])
        return tasks

    # -- kubelet ------------------------------------------------------------------------------

    def kubelet_config(self) -> dict[str, Any]:
        endpoint = f"unix://{self.containerd_socket}"
        # the control plane's gates, as far as its version knows them (tests.harness.cluster)
        gates = dict(g.split("=") for g in self.cp.feature_gates.split(",") if g)
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "containerRuntimeEndpoint": endpoint,
            "imageServiceEndpoint": endpoint,
            "failSwapOn": False,
            "address": self.ip,
            "port": self.port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "podLogsDir": str(self.pod_logs_dir),
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "0%",
                "nodefs.available": "0%",
                "nodefs.inodesFree": "0%",
                "imagefs.available": "0%",
            },
            "serializeImagePulls": False,
            # The kubelet's API is on a veth address of this machine only; /metrics is read by
            # the benchmark without credentials.
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "featureGates": {k: v == "true" for k, v in gates.items()},
            "nodeStatusUpdateFrequency": "2s",
            "syncFrequency": "10s",
        }

    def kubelet_argv(self) -> list[str]:
        return [
            str(self.bin_dir / "kubelet"),
            f"--config={self.dir / 'kubelet-config.json'}",
            f"--kubeconfig={self.dir / 'kubelet.kubeconfig'}",
            f"--root-dir={self.kubelet_dir}",
            f"--cert-dir={self.dir / 'pki'}",
            f"--hostname-override={self.name}",
            f"--node-ip={self.ip}",
            "--v=2",
        ]

    def start_kubelet(self) -> None:
        if not self.healthz_port:
            self.healthz_port = free_port()
            (self.dir / "kubelet-config.json").write_text(json.dumps(self.kubelet_config(), indent=2))
            self.cp.write_kubeconfig(
                self.dir / "kubelet.kubeconfig", f"system:node:{self.name}", node_token(self.name)
            )
        self.kubelet = self._launch("kubelet", self.kubelet_argv())

    def kubelet_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.healthz_port}/healthz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop_kubelet(self, sig: int = signal.SIGTERM) -> None:
        self._stop(self.kubelet, sig)
        self.kubelet = None

    def restart_kubelet(self, sig: int = signal.SIGTERM) -> None:
        """Stop the kubelet (SIGTERM or SIGKILL) and start it again with the same flags."""
        self.stop_kubelet(sig)
        self.kubelet = self._launch("kubelet", self.kubelet_argv())
        wait_until(
            f"the kubelet of {self.name} to be healthy",
            self.kubelet_healthy,
            60,
            lambda: self._tail("kubelet.log"),
        )

    def metrics(self) -> str:
        """The kubelet's /metrics (on the node IP, anonymous)."""
        import ssl

        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        with urllib.request.urlopen(f"https://{self.ip}:{self.port}/metrics", context=ctx, timeout=5) as r:
            return str(r.read().decode())

    # -- driver -------------------------------------------------------------------------------

    def start_driver(self, kubeconfig: Path) -> DriverProcess:
        self.driver = DriverProcess(
            self.name, self.spec.profile, kubeconfig, self.dir, extra_args=self.spec.driver_args
        )
        self.driver.start(wait=True)
        return self.driver

    def registrations(self) -> int:
        """How many times the kubelet confirmed the plugin's registration (the driver's log)."""
        if self.driver is None or not self.driver.log_path.exists():
            return 0
        return self.driver.log_path.read_text(errors="replace").count('"registered with the kubelet"')

    def wait_registered(self, after: int = 0, timeout: float = 60.0) -> None:
        wait_until(
            f"the kubelet of {self.name} to register the plugin",
            lambda: self.registrations() > after,
            timeout,
            lambda: self.driver.log_tail() if self.driver else "",
        )

    def restart_driver(self, sig: int = signal.SIGTERM) -> None:
        assert self.driver is not None
        before = self.registrations()
        self.driver.stop(sig)
        self.driver.start(wait=True)
        self.wait_registered(after=before)

    def kubelet_log(self) -> str:
        return self._tail("kubelet.log", 10**9)

    # -- stop ---------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the driver, the kubelet, containerd, then the sandbox (which takes the rest)."""
        if self.driver is not None:
            self.driver.stop()
        self._stop(self.kubelet)
        self.kubelet = None
        self._stop(self.containerd)
        self.containerd = None
        if self.sandbox is not None and self.sandbox.poll() is None:
            self.sandbox.kill()  # --kill-child: PID 1 goes, and with it the whole namespace
            self.sandbox.wait(10)


def wait_until(what: str, probe: Any, timeout: float, detail: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe():
            return
        time.sleep(0.1)  # the poll interval
    raise TimeoutError(
        f"timed out after {timeout}s waiting for {what}" + (f":\n{detail()}" if detail else "")
    )


@dataclass
class Nodes:
    """Several real nodes on this machine, with one reaper for what the kernel leaves behind."""

    cp: ControlPlane
    base: Path
    bin_dir: Path
    nodes: dict[str, Node] = field(default_factory=dict)
    reaper: subprocess.Popen[bytes] | None = None
    reaper_pipe: int = -1
    keep_files: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    # The host's links before the first node: a teardown's check never counts those.
    links_before: frozenset[str] | None = None

    @property
    def state_file(self) -> Path:
        return self.base / "reaper.json"

    @classmethod
    def start(
        cls,
        cp: ControlPlane,
        specs: Sequence[NodeSpec],
        base: Path | None = None,
        bin_dir: Path | None = None,
        driver_kubeconfig: Path | None = None,
        keep_files: bool = False,
        progress: Callable[[str], None] | None = None,
        daemonset: bool = False,
    ) -> Nodes:
        """Start every node, wait until each is Ready and its driver registered with its kubelet.

        The control plane must run the node-lifecycle controller and know the kubelets'
        tokens: `ControlPlane.start(node_lifecycle=True, extra_tokens=node_tokens(names))`
        (`node_cluster` does both). `progress` gets one line per node and per phase.
        """
        t0 = time.monotonic()
        say = progress or (lambda _line: None)
        bin_dir = bin_dir or build_node_binaries()
        # Short: unix socket paths under it must stay below 108 bytes.
        base = base or Path(tempfile.mkdtemp(prefix="dra-nodes-", dir="/tmp"))
        before = frozenset(link_names())
        nodes = cls(cp=cp, base=base, bin_dir=bin_dir, keep_files=keep_files, links_before=before)
        token = hashlib.sha256(str(base).encode()).hexdigest()[:5]
        subnet = _free_subnet(int(token, 16))
        restrict_oom = not has_cap_sys_resource()
        if restrict_oom:
            logger.info(
                "root lacks CAP_SYS_RESOURCE here: negative oom_score_adj is refused, so containerd "
                "runs with restrict_oom_score_adj = true"
            )
        try:
            nodes._start_reaper()
            images = write_test_images(base / "images")
            for i, spec in enumerate(specs, start=1):
                node_dir = base / spec.name
                node_dir.mkdir(parents=True)
                node = Node(
                    spec=spec,
                    index=i,
                    dir=node_dir,
                    bin_dir=bin_dir,
                    subnet=subnet,
                    cp=cp,
                    link=f"dn{token}{i}",
                    bridge=f"db{token}{i}",
                    restrict_oom=restrict_oom,
                    daemonset=daemonset,
                )
                nodes.nodes[spec.name] = node
                nodes._record()
                if not daemonset:  # else made in the sandbox, on its own /run
                    node.cdi_dir.mkdir()
                node.add_node_ip()
                node.write_cni_config()
                node.start_sandbox()
                nodes._record()
                node.start_containerd()
                node.import_images(images)
                node.start_kubelet()
                nodes._record()
                logger.info(
                    "node started",
                    node=spec.name,
                    ip=node.ip,
                    profile=spec.profile,
                    seconds=round(time.monotonic() - t0, 1),
                )
                say(f"node {spec.name}: containerd and kubelet started (node IP {node.ip})")
            nodes.timings["processes_started_s"] = time.monotonic() - t0
            api = sync_client(str(cp.kubeconfig))
            for node in nodes.nodes.values():
                nodes.wait_node_ready(api, node)
            nodes.timings["nodes_ready_s"] = time.monotonic() - t0
            logger.info("nodes Ready", seconds=round(nodes.timings["nodes_ready_s"], 1))
            say(f"nodes Ready: {', '.join(nodes.nodes)}")
            for node in nodes.nodes.values():
                if not daemonset:
                    node.start_driver(driver_kubeconfig or cp.kubeconfig)
            for node in nodes.nodes.values():
                if not daemonset:
                    node.wait_registered()
            nodes.timings["drivers_registered_s"] = time.monotonic() - t0
            drivers = [(n.name, d) for n in nodes.nodes.values() if (d := n.driver) is not None]
            if drivers:
                say(
                    "one `dra-driver kubelet-plugin` per node, registered with its kubelet: "
                    + ", ".join(f"{name} (--simulate {d.profile}, pid {d.pid})" for name, d in drivers)
                )
        except BaseException:
            try:
                nodes.stop()
            except LinksLeftBehind as e:  # the failure that got here is the one to report
                logger.warning("links left behind after a failed start", error=str(e))
            raise
        logger.info(
            "nodes ready", nodes=list(nodes.nodes), seconds=round(time.monotonic() - t0, 1), base=str(base)
        )
        return nodes

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def wait_node_ready(self, api: client.ApiClient, node: Node, timeout: float = 90.0) -> None:
        def ready() -> bool:
            if node.kubelet is None or node.kubelet.nsenter.poll() is not None:
                raise RuntimeError(f"the kubelet of {node.name} exited:\n{node._tail('kubelet.log')}")
            try:
                obj = sync_request(api, "GET", f"/api/v1/nodes/{node.name}")
            except Exception:
                return False
            conditions = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])}
            taints = [t["key"] for t in obj.get("spec", {}).get("taints", []) or []]
            return conditions.get("Ready") == "True" and "node.kubernetes.io/not-ready" not in taints

        wait_until(
            f"node {node.name} to be Ready and untainted", ready, timeout, lambda: node._tail("kubelet.log")
        )

    # -- the reaper -----------------------------------------------------------------------------

    def _start_reaper(self) -> None:
        read_end, write_end = os.pipe()
        self._record()
        self.reaper = subprocess.Popen(
            [sys.executable, "-m", "tests.harness.node", "reap", str(self.state_file)],
            stdin=read_end,
            cwd=REPO_ROOT,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
        )
        os.close(read_end)
        self.reaper_pipe = write_end

    def _record(self) -> None:
        """Write what the reaper must undo: links, sysctls as found, sandbox PIDs, files."""
        previous: dict[str, Any] = {}
        if self.state_file.exists():
            previous = json.loads(self.state_file.read_text())
        sysctls = previous.get("sysctls") or {s: _read_sysctl(s) for s in SYSCTLS}
        # containerd puts every container's cgroup under <hierarchy>/k8s.io (its namespace).
        new_cgroup_parents = previous.get("new_cgroup_parents")
        if new_cgroup_parents is None:
            new_cgroup_parents = [str(p) for p in _cgroup_parents() if not p.exists()]
        state = {
            "base": str(self.base),
            "keep_files": self.keep_files,
            "sysctls": sysctls,
            "links": [n.link for n in self.nodes.values()] + [n.bridge for n in self.nodes.values()],
            "bridges": [n.bridge for n in self.nodes.values()],
            "lo_addresses": [f"{n.ip}/32" for n in self.nodes.values()] if NODE_IP_ON_LO else [],
            "sandboxes": [n.sandbox.pid for n in self.nodes.values() if n.sandbox is not None],
            "containerd_roots": [str(n.dir / "containerd" / "root") for n in self.nodes.values()],
            "new_cgroup_parents": new_cgroup_parents,
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    def stop(self) -> None:
        """Stop every node and let the reaper undo the rest; waits until it has. Then raises
        LinksLeftBehind if a link the harness made, or saw on a node's bridge, is still there."""
        for node in reversed(list(self.nodes.values())):
            try:
                node.stop()
            except Exception as e:  # keep going: the reaper still cleans up
                logger.warning("stopping a node failed", node=node.name, error=str(e))
        # The sandboxes are gone: no pod can join a bridge any more, and every pod veth that is
        # still there is a port of its node's bridge until the reaper deletes both.
        ours = {p for n in self.nodes.values() for p in bridge_ports(n.bridge)}
        ours |= {name for n in self.nodes.values() for name in (n.link, n.link + "p", n.bridge)}
        if self.reaper_pipe >= 0:
            os.close(self.reaper_pipe)
            self.reaper_pipe = -1
        if self.reaper is not None:
            try:
                self.reaper.wait(60)
            except subprocess.TimeoutExpired:
                logger.warning("the reaper is still running", pid=self.reaper.pid)
            self.reaper = None
        if self.links_before is not None:
            left = links_left_behind(self.links_before, link_names(), ours)
            if left:
                raise LinksLeftBehind(
                    f"the node harness left {len(left)} link(s) of its own on the host: {', '.join(left)} "
                    f"(its node links, bridges and the pod veths seen on them: {', '.join(sorted(ours))})"
                )


@contextlib.contextmanager
def node_cluster(
    specs: Sequence[NodeSpec],
    work_dir: Path,
    *,
    nodes_dir: Path | None = None,
    cluster_bin_dir: Path | None = None,
    node_bin_dir: Path | None = None,
    keep_files: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Iterator[tuple[ControlPlane, Nodes]]:
    """A control plane for real kubelets and one real node per spec, each with its driver.

    The control plane (files under `work_dir`) runs the node-lifecycle controller and knows
    each kubelet's `system:node:<name>` token; `Nodes.start` brings the nodes up against it.
    On exit the nodes are stopped, then the control plane; its files stay (the caller owns
    `work_dir`), the nodes' files only with `keep_files`. Shared by tests/node and `make demo`.
    """
    cp = ControlPlane.start(
        work_dir=work_dir,
        bin_dir=cluster_bin_dir,
        node_lifecycle=True,
        extra_tokens=node_tokens([s.name for s in specs]),
    )
    nodes: Nodes | None = None
    try:
        if progress is not None:
            progress(f"control plane up at {cp.server}")
        if nodes_dir is not None:
            nodes_dir.mkdir(parents=True, exist_ok=True)
        nodes = Nodes.start(
            cp, specs, base=nodes_dir, bin_dir=node_bin_dir, keep_files=keep_files, progress=progress
        )
        yield cp, nodes
    finally:
        try:
            if nodes is not None:
                nodes.stop()
        finally:
            cp.stop(remove=False)


def _read_sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", name).read_text().strip()
    except OSError:
        return None


def _cgroup_parents() -> list[Path]:
    root = Path("/sys/fs/cgroup")
    return [h / "k8s.io" for h in sorted(root.iterdir()) if h.is_dir() and not h.is_symlink()]


_HEX_ID = re.compile(r"^[0-9a-f]{64}$")


def _container_ids(roots: Sequence[str]) -> set[str]:
    ids: set[str] = set()
    for root in roots:
        for kind in ("sandboxes", "containers"):
            d = Path(root) / "io.containerd.grpc.v1.cri" / kind
            if d.is_dir():
                ids.update(p.name for p in d.iterdir() if _HEX_ID.match(p.name))
    return ids


def _remove_cgroups(ids: set[str]) -> int:
    """rmdir the (empty, their processes gone) cgroups that runc made for these containers."""
    removed = 0
    if not ids:
        return 0
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        if not hierarchy.is_dir():
            continue
        for dirpath, dirnames, _ in os.walk(hierarchy, topdown=False):
            for d in dirnames:
                if d in ids or any(d.endswith(i) or d.endswith(i + ".scope") for i in ids):
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(dirpath, d))
                        removed += 1
    return removed


def reap(state_file: Path) -> None:
    """Wait for the launcher to go (EOF on stdin), then undo what the kernel did not."""
    with contextlib.suppress(OSError):
        while sys.stdin.buffer.read(4096):
            pass
    state = json.loads(state_file.read_text())
    base = state["base"]
    for pid in state["sandboxes"]:
        if pid_alive(pid) and base in _cmdline(pid) and "unshare" in _cmdline(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    sandboxes = state["sandboxes"]
    while time.monotonic() < deadline and any(pid_alive(p) and base in _cmdline(p) for p in sandboxes):
        time.sleep(0.1)  # the poll interval
    # The namespaces go once their last process is reaped; give the kernel a moment.
    time.sleep(0.5)  # not a wait: cleanup, and the links still there are deleted below anyway
    # A pod's veth goes with its network namespace only once nothing pins that namespace (an
    # orphaned TCP socket can, for minutes): its host end goes now, by name, while it is still
    # a port of the node's bridge (made by this run's CNI config, so ours).
    for bridge in state.get("bridges", []):
        for port in bridge_ports(bridge):
            _ip("link", "del", port, check=False)
    for link in state["links"]:
        if _ip("link", "show", link, check=False).returncode == 0:
            _ip("link", "del", link, check=False)
    for address in state.get("lo_addresses", []):
        _ip("addr", "del", address, "dev", "lo", check=False)
    for name, value in state["sysctls"].items():
        if value is not None and _read_sysctl(name) != value:
            with contextlib.suppress(OSError):
                Path("/proc/sys", name).write_text(value)
    _remove_cgroups(_container_ids(state["containerd_roots"]))
    for parent in state.get("new_cgroup_parents", []):
        with contextlib.suppress(OSError):
            os.rmdir(parent)  # only once empty: another user's containers keep it
    if not state.get("keep_files"):
        shutil.rmtree(base, ignore_errors=True)


def _cli(argv: Sequence[str]) -> int:
    if len(argv) == 2 and argv[0] == "reap":
        reap(Path(argv[1]))
        return 0
    print("usage: python -m tests.harness.node reap STATE_FILE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
