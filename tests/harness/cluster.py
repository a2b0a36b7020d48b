"""A real Kubernetes control plane on loopback, for the integration tests and the demo.

Starts etcd -> kube-apiserver -> kube-controller-manager -> kube-scheduler (binaries
built by `hack/cluster/build.sh`) in a temporary directory, with Node+RBAC
authorization, service-account token signing and every DRA API the driver uses.
Nothing here is a fake: the same binaries a cluster runs, only without kubelets
(tests create Node objects themselves). `stop()` leaves no process behind; the
processes also die with their parent (PR_SET_PDEATHSIG), so an interrupted test
run cannot leak an etcd.

Used as a library (`ControlPlane.start()`) and as a command:
    python -m tests.harness.cluster up|down|status [--state-dir D]
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "cluster" / "build.sh"
DEFAULT_STATE_DIR = Path(os.environ.get("DRA_CLUSTER_STATE", "/tmp/gpu-dra-driver-cluster"))

ADMIN_TOKEN = "admin-token"
SCHEDULER_TOKEN = "scheduler-token"
CONTROLLER_MANAGER_TOKEN = "controller-manager-token"

# Every DRA feature the driver uses. On 1.37 they are on by default except the alphas
# (list-type attributes); naming them keeps the intent visible and fails loudly if a
# gate disappears. A version that does not know a gate gets it left out (GATE_SINCE).
FEATURE_GATES = ",".join(
    [
        "DRAPrioritizedList=true",
        "DRAAdminAccess=true",
        "DRADeviceTaints=true",
        "DRADeviceTaintRules=true",
        "DRAPartitionableDevices=true",
        "DRAConsumableCapacity=true",
        "DRAExtendedResource=true",
        "DRAListTypeAttributes=true",
        "ResourceHealthStatus=true",
        "DRAResourceClaimDeviceStatus=true",
    ]
)


# The first minor version whose components know a gate; one that does not know a gate it is
# given refuses to start (`unrecognized feature gate: DRADeviceTaintRules` on 1.34). Gates
# not listed are known to every version the harness runs (1.34+). From the versioned gate
# tables (reference/dra-protocol.md 1.10, reference/test-cluster.md 3.3).
GATE_SINCE: dict[str, int] = {
    "DRADeviceTaintRules": 35,
    "DRAListTypeAttributes": 36,
    "DRANodeAllocatableResources": 36,
    "DRAResourceClaimGranularStatusAuthorization": 36,
    "DRAFractionalCapacityRange": 37,
    "DRAOptionalNodeOperations": 37,
}

# DRA_FEATURE_GATES=all (default): the gates above, as far as the version knows them.
# DRA_FEATURE_GATES=default: no --feature-gates at all, the version's own defaults (what a
# stock cluster of that version runs; `make test-versions` runs both).
GATE_MODES = ("all", "default")


def gates_for(gates: str, minor: int) -> str:
    """`gates` (a --feature-gates value) less the gates version 1.`minor` does not know."""
    kept = [g for g in gates.split(",") if g and GATE_SINCE.get(g.split("=")[0], 0) <= minor]
    return ",".join(kept)


def gate_mode() -> str:
    mode = os.environ.get("DRA_FEATURE_GATES", "all")
    if mode not in GATE_MODES:
        raise ValueError(f"DRA_FEATURE_GATES={mode!r}: write one of {', '.join(GATE_MODES)}")
    return mode


def kube_version(bin_dir: Path) -> tuple[int, int, int]:
    """The version of the built kube-apiserver (`Kubernetes v1.34.4` -> (1, 34, 4))."""
    out = subprocess.run(
        [str(bin_dir / "kube-apiserver"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    major, minor, patch = out.split()[-1].lstrip("v").split("-")[0].split(".")[:3]
    return int(major), int(minor), int(patch)


def _log(msg: str) -> None:
    print(f"[cluster] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_binaries() -> Path:
    """Build (or reuse from the cache) the control plane; returns the binary directory.
    The version: DRA_K8S_VERSION (hack/cluster/build.sh reads it), default v1.37.2."""
    override = os.environ.get("DRA_CLUSTER_BIN")
    if override:
        return Path(override)
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"control-plane build failed (exit {proc.returncode}); see the log above")
    return Path(proc.stdout.strip().splitlines()[-1])


def die_with_parent() -> None:
    # Linux only: SIGKILL the child when the process that started it dies, so that a
    # killed pytest or demo never leaves etcd or the apiserver running.
    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class ControlPlane:
    """One running control plane. Create with `ControlPlane.start()`."""

    bin_dir: Path
    work_dir: Path
    api_port: int
    feature_gates: str = FEATURE_GATES
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)
    detach: bool = False
    node_lifecycle: bool = False
    version: tuple[int, int, int] = (0, 0, 0)  # of the binaries, read at start

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.work_dir / "admin.kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.work_dir / "certs" / "apiserver.crt"

    # -- start -------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        work_dir: Path | None = None,
        bin_dir: Path | None = None,
        detach: bool = False,
        extra_tokens: Sequence[tuple[str, str, str]] = (),
        node_lifecycle: bool = False,
    ) -> ControlPlane:
        """Start all four components and wait until the API server is ready.

        `detach` starts the processes in their own session without the parent-death
        signal, for `make cluster-up`, where the launcher exits and the cluster stays.
        `extra_tokens` adds static (token, user, groups) identities, e.g. a kubelet's
        `system:node:<name>` in group `system:nodes` (tests.harness.node).
        `node_lifecycle` runs the node-lifecycle controller, for real kubelets that
        heartbeat: it lifts the not-ready taint once a node reports Ready. Without
        kubelets it would taint the tests' Node objects unreachable, so it is off by default.
        """
        t0 = time.monotonic()
        bin_dir = bin_dir or build_binaries()
        work_dir = Path(work_dir or tempfile.mkdtemp(prefix="gpu-dra-cluster-"))
        work_dir.mkdir(parents=True, exist_ok=True)
        cp = cls(bin_dir=bin_dir, work_dir=work_dir, api_port=free_port(), detach=detach,
                 node_lifecycle=node_lifecycle, version=kube_version(bin_dir))
        cp.feature_gates = "" if gate_mode() == "default" else gates_for(cp.feature_gates, cp.version[1])
        try:
            cp._write_credentials(extra_tokens)
            cp._start_etcd()
            cp._start_apiserver()
            cp._wait_ready()
            cp._write_kubeconfigs()
            cp._start_controller_manager()
            cp._start_scheduler()
            cp._wait_default_namespace_ready()
        except BaseException:
            cp.stop()
            raise
        (work_dir / "state.json").write_text(
            json.dumps({"pids": {n: p.pid for n, p in cp.processes.items()}, "apiPort": cp.api_port})
        )
        _log(
            f"control plane v{'.'.join(map(str, cp.version))} ready in {time.monotonic() - t0:.1f}s at "
            f"{cp.server} (kubeconfig {cp.kubeconfig}; feature gates: {cp.feature_gates or 'the defaults'})"
        )
        return cp

    def _spawn(self, name: str, argv: Sequence[str]) -> None:
        self.argv[name] = list(argv)
        log = open(self.work_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        _log(f"starting {name}")
        self.processes[name] = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.work_dir,
            start_new_session=True,
            preexec_fn=None if self.detach else die_with_parent,
        )
        log.close()

    def _write_credentials(self, extra_tokens: Sequence[tuple[str, str, str]]) -> None:
        certs = self.work_dir / "certs"
        certs.mkdir(exist_ok=True)
        sa_key = certs / "sa.key"
        subprocess.run(["openssl", "genrsa", "-out", str(sa_key), "2048"], check=True, capture_output=True)
        subprocess.run(
            ["openssl", "rsa", "-in", str(sa_key), "-pubout", "-out", str(certs / "sa.pub")],
            check=True,
            capture_output=True,
        )
        rows = [
            f'{ADMIN_TOKEN},admin,admin,"system:masters"',
            f"{SCHEDULER_TOKEN},system:kube-scheduler,scheduler,",
            f"{CONTROLLER_MANAGER_TOKEN},system:kube-controller-manager,controller-manager,",
            *(f'{tok},{user},{user},"{groups}"' for tok, user, groups in extra_tokens),
        ]
        (self.work_dir / "tokens.csv").write_text("\n".join(rows) + "\n")

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._spawn(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                f"--data-dir={self.work_dir / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=default=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",
                "--quota-backend-bytes=2147483648",
                "--log-level=warn",
            ],
        )

    def _start_apiserver(self) -> None:
        certs = self.work_dir / "certs"
        self._spawn(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.api_port}",
                f"--cert-dir={certs}",
                "--endpoint-reconciler-type=none",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={certs / 'sa.pub'}",
                f"--service-account-signing-key-file={certs / 'sa.key'}",
                "--authorization-mode=Node,RBAC",
                f"--token-auth-file={self.work_dir / 'tokens.csv'}",
                "--enable-admission-plugins=NodeRestriction",
                "--runtime-config=api/all=true",
                *self._gate_flags(),
                "--allow-privileged=true",
                # Real kubelets have no DNS name here: reach them by their node IP.
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                "--v=1",
            ],
        )

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        """GET a path on the API server as admin; (status, body)."""
        req = urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        try:
            with urllib.request.urlopen(req, context=self._ssl_context(), timeout=timeout) as resp:
                return int(resp.status), resp.read().decode()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read().decode()

    def _check_alive(self) -> None:
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                tail = (self.work_dir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                status, body = self.get("/readyz", timeout=2)
                if status == 200:
                    return
                last = body[-500:]
            except OSError as e:
                last = str(e)
            time.sleep(0.3)  # the poll interval
        raise TimeoutError(f"kube-apiserver not ready after {timeout}s: {last}")

    def _kubeconfig(self, user: str, token: str) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "local",
                        "cluster": {"server": self.server, "certificate-authority": str(self.ca_file)},
                    }
                ],
                "users": [{"name": user, "user": {"token": token}}],
                "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
                "current-context": "local",
            },
            indent=2,
        )

    def write_kubeconfig(self, path: Path, user: str, token: str) -> Path:
        path.write_text(self._kubeconfig(user, token))
        path.chmod(0o600)
        return path

    def _write_kubeconfigs(self) -> None:
        self.write_kubeconfig(self.kubeconfig, "admin", ADMIN_TOKEN)
        self.write_kubeconfig(self.work_dir / "scheduler.kubeconfig", "scheduler", SCHEDULER_TOKEN)
        self.write_kubeconfig(self.work_dir / "kcm.kubeconfig", "kcm", CONTROLLER_MANAGER_TOKEN)

    def _client_component_flags(self, kubeconfig: str) -> list[str]:
        """What the controller-manager and the scheduler share: identity, loopback serving, gates."""
        return [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            *self._gate_flags(),
        ]

    def _gate_flags(self) -> list[str]:
        return [f"--feature-gates={self.feature_gates}"] if self.feature_gates else []

    def _start_controller_manager(self) -> None:
        certs = self.work_dir / "certs"
        self._spawn(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                *self._client_component_flags(str(self.work_dir / "kcm.kubeconfig")),
                f"--service-account-private-key-file={certs / 'sa.key'}",
                f"--root-ca-file={self.ca_file}",
                "--use-service-account-credentials=true",
                "--service-cluster-ip-range=10.0.0.0/24",
                # Without kubelets (no heartbeats) the node-lifecycle controller would
                # taint every test Node unreachable; with real kubelets it lifts the
                # not-ready taint.
                "--controllers=*" if self.node_lifecycle else "--controllers=*,-node-lifecycle-controller",
                "--v=1",
            ],
        )

    def _start_scheduler(self) -> None:
        self._spawn(
            "kube-scheduler",
            [
                str(self.bin_dir / "kube-scheduler"),
                *self._client_component_flags(str(self.work_dir / "scheduler.kubeconfig")),
                "--v=2",
            ],
        )

    def _wait_default_namespace_ready(self, timeout: float = 60.0) -> None:
        # ServiceAccount admission rejects pods until the controller-manager has made
        # the `default` ServiceAccount.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            status, _ = self.get("/api/v1/namespaces/default/serviceaccounts/default")
            if status == 200:
                return
            time.sleep(0.3)  # the poll interval
        raise TimeoutError("the default ServiceAccount did not appear; is kube-controller-manager running?")

    # -- helpers -------------------------------------------------------------------------

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the kubectl built with the control plane against this cluster."""
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            check=check,
            input=input,
        )

    def stop_component(self, name: str) -> None:
        """Stop one component (for outage tests); `start_component` brings it back as it was."""
        _terminate(self.processes.pop(name).pid, name)

    def start_component(self, name: str) -> None:
        self._spawn(name, self.argv[name])
        if name == "kube-apiserver":
            self._wait_ready()

    # -- stop --------------------------------------------------------------------------

    def stop(self, remove: bool = True) -> None:
        """Stop every component (newest first), escalating to SIGKILL; never leaves one running."""
        for name in reversed(list(self.processes)):
            _terminate(self.processes[name].pid, name)
        self.processes.clear()
        if remove:
            shutil.rmtree(self.work_dir, ignore_errors=True)


def _terminate(pid: int, name: str, grace: float = 10.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child (cluster-down from another process)
            done = 0 if pid_alive(pid) else pid
        if done:
            return
        time.sleep(0.1)  # the poll interval
    _log(f"{name} (pid {pid}) ignored SIGTERM; killing")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def running(**kwargs: object) -> Iterator[ControlPlane]:
    """`with running() as cp:` starts a control plane and always stops it."""
    cp = ControlPlane.start(**kwargs)  # type: ignore[arg-type]
    try:
        yield cp
    finally:
        cp.stop()


def _cli(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.harness.cluster")
    parser.add_argument("command", choices=["up", "down", "build"])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    args = parser.parse_args(argv)
    state_dir: Path = args.state_dir
    if args.command == "build":
        print(build_binaries())
        return 0
    if args.command == "up":
        if (state_dir / "state.json").exists():
            _log(f"a cluster is already recorded in {state_dir}; run `make cluster-down` first")
            return 1
        cp = ControlPlane.start(work_dir=state_dir, detach=True)
        status, body = cp.get("/apis/resource.k8s.io")
        versions = [v["version"] for v in json.loads(body).get("versions", [])] if status == 200 else []
        _log(f"served resource.k8s.io versions: {', '.join(versions)}")
        print(f"KUBECONFIG={cp.kubeconfig}")
        return 0
    state_file = state_dir / "state.json"
    if not state_file.exists():
        _log(f"no cluster recorded in {state_dir}")
        return 0
    pids: dict[str, int] = json.loads(state_file.read_text())["pids"]
    for name, pid in reversed(list(pids.items())):
        if pid_alive(pid):
            _terminate(pid, name)
    shutil.rmtree(state_dir, ignore_errors=True)
    _log("cluster stopped")
    return 0


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
