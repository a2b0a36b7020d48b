"""The per-domain IMEX daemons of this node: started by the kubelet plugin at a domain's first
channel Prepare here, stopped after its last channel claim here is unprepared.

Each domain has a directory `<root>/<domainUID>/`, made before its daemon starts, with the
daemon's config (`imexd.cfg`), its peers (`nodes.cfg`, one address per line), its pid file and
log, the domain's name (`domain.json`) and one file per claim of the domain on this node
(`claims/<claimUID>`, holding the claim's channel request). The directory is the record: a
plugin that restarts finds every daemon there and adopts it (its process carries the marker
`GPU_DRA_IMEX_DOMAIN=<uid>`, so a reused PID never passes for it). Peers that change are
written to `nodes.cfg` and the daemon is told with SIGUSR1 (what NVIDIA's daemon wrapper does).
Readiness is `nvidia-imex-ctl -c imexd.cfg -q` answering `READY`.

Blocking I/O (call it from a worker thread in async code); the caller holds the plugin's lock
around `ensure`, `release` and `sweep`. It must not read the API server nor decide whether a
claim may join a domain (`dra_driver.plugin.channel_gate` does).
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
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from dra_driver.atomic import write_file_atomic
from dra_driver.cdi.spec import validate_claim_uid
from dra_driver.driver_root.user_space import BINARY_DIRS, find_tool, library_dirs
from dra_driver.imex.channels import ChannelRequest

log = structlog.get_logger(__name__)

DAEMON_BINARY: Final = "nvidia-imex"
CONTROL_BINARY: Final = "nvidia-imex-ctl"
MARKER_ENV: Final = "GPU_DRA_IMEX_DOMAIN"
SERVER_PORT: Final = 50000
COMMAND_PORT: Final = 50005
# A claim file with no checkpoint entry is a Prepare still waiting (or one whose pod went away
# before it finished): kept this long after its last attempt before the sweep drops it.
WAITING_CLAIM_GRACE_SECONDS: Final = 600.0


class ImexError(Exception):
    """An IMEX daemon could not be started, asked or stopped; the message says why."""


@dataclass(frozen=True)
class DomainDirs:
    base: Path

    @property
    def config(self) -> Path:
        return self.base / "imexd.cfg"

    @property
    def nodes(self) -> Path:
        return self.base / "nodes.cfg"

    @property
    def pid_file(self) -> Path:
        return self.base / "imexd.pid"

    @property
    def log(self) -> Path:
        return self.base / "imexd.log"

    @property
    def domain(self) -> Path:
        return self.base / "domain.json"

    @property
    def claims(self) -> Path:
        return self.base / "claims"


def daemon_config(dirs: DomainDirs, bind_ip: str) -> str:
    """The daemon's settings (NVIDIA's template, v0.5.0): in the foreground, no quorum wait
    beyond recovery, its command port on this node's address."""
    return "\n".join([
        f"LOG_FILE_NAME={dirs.log}",
        "LOG_LOCAL_LEVEL=4",
        "LOG_APPEND_TO_LOG=1",
        "DAEMONIZE=0",
        f"SERVER_PORT={SERVER_PORT}",
        f"IMEX_NODE_CONFIG_FILE={dirs.nodes}",
        f"IMEX_CMD_BIND_INTERFACE_IP={bind_ip}",
        f"IMEX_CMD_PORT={COMMAND_PORT}",
        "IMEX_CMD_ENABLED=1",
        "IMEX_WAIT_FOR_QUORUM=RECOVERY",
        "IMEX_ENABLE_AUTH_ENCRYPTION=0",
        "",
    ])


class ImexDaemons:
    """Starts, finds, asks and stops this node's IMEX daemons. `host_cgroup=True` starts each in
    the cgroups of PID 1 (`dra_driver.sharing.mps_launch`), so it outlives the plugin's container."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        driver_root: str | os.PathLike[str],
        *,
        host_cgroup: bool = False,
        ready_timeout: float = 5.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self.root = Path(root)
        self.driver_root = Path(driver_root)
        self.host_cgroup = host_cgroup
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # reaped when they exit
        # (uid, namespace, name) of each domain whose daemon stopped, until the plugin has
        # removed this node from its status (`left`)
        self._left: deque[tuple[str, str, str]] = deque()

    def dirs(self, domain_uid: str) -> DomainDirs:
        validate_claim_uid(domain_uid)  # a UID as well, and it names a directory
        return DomainDirs(self.root / domain_uid)

    def _tool(self, name: str) -> str:
        found = find_tool(self.driver_root, name)
        if found is None:
            raise ImexError(f"{name} not found under the driver root {self.driver_root} (looked in "
                            f"{', '.join(BINARY_DIRS)}): ComputeDomains need the driver's IMEX tools")
        return found

    # -- what is on disk and in /proc -------------------------------------------------------

    def domains(self) -> list[str]:
        try:
            return sorted(p.name for p in self.root.iterdir() if p.is_dir())
        except FileNotFoundError:
            return []

    def claims_of(self, domain_uid: str) -> dict[str, float]:
        """The domain's claims on this node, each with when its Prepare last asked."""
        out = {}
        with contextlib.suppress(FileNotFoundError):
            for p in self.dirs(domain_uid).claims.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    out[p.name] = p.stat().st_mtime
        return out

    def request_of(self, claim_uid: str) -> ChannelRequest | None:
        """The channel request a claim was prepared with (recovery rewrites its spec from it)."""
        for uid in self.domains():
            try:
                return ChannelRequest.from_json(json.loads((self.dirs(uid).claims / claim_uid).read_text()))
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.error("unreadable IMEX claim file", claim_uid=claim_uid, domain_uid=uid, error=str(e))
                return None
        return None

    def domain_name(self, domain_uid: str) -> tuple[str, str] | None:
        """(namespace, name) of the domain, as recorded when its daemon started."""
        try:
            data = json.loads(self.dirs(domain_uid).domain.read_text())
            return str(data["namespace"]), str(data["name"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def pid(self, domain_uid: str) -> int | None:
        """The domain's running daemon, if any (a reused PID lacks the domain's marker)."""
        for child in list(self._children.values()):
            if child.poll() is not None:
                del self._children[child.pid]
        try:
            pid = int(self.dirs(domain_uid).pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                zombie = f.read().rsplit(b")", 1)[-1].split()[0] == b"Z"
        except OSError:
            return None
        return pid if not zombie and f"{MARKER_ENV}={domain_uid}".encode() in environ else None

    def ready(self, domain_uid: str) -> bool:
        """Whether the domain's daemon here answers READY (False if it is not running)."""
        if self.pid(domain_uid) is None:
            return False
        try:
            done = subprocess.run(
                [self._tool(CONTROL_BINARY), "-c", str(self.dirs(domain_uid).config), "-q"],
                capture_output=True, timeout=self.ready_timeout, env=self._env(), stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired, ImexError) as e:
            log.warning("asking the IMEX daemon failed", domain_uid=domain_uid, error=str(e))
            return False
        return done.returncode == 0 and done.stdout.decode(errors="replace").strip() == "READY"

    # -- start, peers, stop -----------------------------------------------------------------

    def ensure(
        self, domain_uid: str, namespace: str, name: str, claim_uid: str, request: ChannelRequest,
        peers: Iterable[str], bind_ip: str,
    ) -> None:
        """Record the claim, write the peers, and start the domain's daemon if it does not run.
        Raises ImexError."""
        validate_claim_uid(claim_uid)
        dirs = self.dirs(domain_uid)
        dirs.claims.mkdir(parents=True, exist_ok=True, mode=0o755)
        if not dirs.domain.exists():
            write_file_atomic(dirs.domain, json.dumps({"namespace": namespace, "name": name}).encode())
        write_file_atomic(dirs.claims / claim_uid, json.dumps(request.to_json()).encode())
        nodes = "".join(f"{p}\n" for p in peers)
        pid = self.pid(domain_uid)
        if not dirs.nodes.exists() or dirs.nodes.read_text() != nodes:
            write_file_atomic(dirs.nodes, nodes.encode())
            if pid is not None:
                os.kill(pid, signal.SIGUSR1)  # re-read the peers
                log.info("IMEX daemon told of new peers", domain_uid=domain_uid, peers=nodes.split())
        if pid is None:
            write_file_atomic(dirs.config, daemon_config(dirs, bind_ip).encode())
            self._launch(domain_uid, dirs)

    def _env(self, domain_uid: str | None = None) -> dict[str, str]:
        lib_dirs = [str(self.driver_root / d) for d in library_dirs() if (self.driver_root / d).is_dir()]
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
        if lib_dirs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_dirs)
        if domain_uid is not None:
            env[MARKER_ENV] = domain_uid
        return env

    def _launch(self, domain_uid: str, dirs: DomainDirs) -> None:
        cmd = [self._tool(DAEMON_BINARY), "-c", str(dirs.config)]
        env = self._env(domain_uid)
        if self.host_cgroup:
            launcher = [sys.executable, "-m", "dra_driver.sharing.mps_launch", "--join-cgroups-of", "1", "--"]
            cmd = [*launcher, *cmd]
            env |= {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "VIRTUAL_ENV")}
        with open(dirs.base / "start.log", "ab") as out:  # never a pipe: the daemon would hold it open
            try:
                child = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                         start_new_session=True, close_fds=True)
            except OSError as e:
                raise ImexError(f"starting {cmd[-3]} failed: {e}") from e
        self._children[child.pid] = child
        write_file_atomic(dirs.pid_file, f"{child.pid}\n".encode())
        log.info("IMEX daemon started", domain_uid=domain_uid, pid=child.pid, host_cgroup=self.host_cgroup)

    def release(self, claim_uid: str) -> list[str]:
        """Forget the claim; stop each daemon left without claims. The domains stopped."""
        stopped = []
        for uid in self.domains():
            claim = self.dirs(uid).claims / claim_uid
            if claim.exists():
                claim.unlink()
                if not self.claims_of(uid):
                    self.stop(uid)
                    stopped.append(uid)
        return stopped

    def sweep(self, held: frozenset[str], now: float | None = None) -> list[str]:
        """At start: drop claim files of claims that are not held (no checkpoint entry) and whose
        Prepare last asked long ago; stop daemons left without claims, start again those of
        domains with claims that died. The domains stopped."""
        now = time.time() if now is None else now
        stopped = []
        for uid in self.domains():
            for claim, asked in self.claims_of(uid).items():
                if claim not in held and now - asked > WAITING_CLAIM_GRACE_SECONDS:
                    (self.dirs(uid).claims / claim).unlink(missing_ok=True)
            if not self.claims_of(uid):
                self.stop(uid)
                stopped.append(uid)
            elif self.pid(uid) is None and self.dirs(uid).config.exists():
                log.warning("the IMEX daemon of a domain with claims here is not running; starting it again",
                            domain_uid=uid)
                self._launch(uid, self.dirs(uid))
        return stopped

    def left(self) -> list[tuple[str, str, str]]:
        """The domains stopped since the last call: (uid, namespace, name)."""
        out = []
        while self._left:
            out.append(self._left.popleft())
        return out

    def stop(self, domain_uid: str) -> None:
        """End the domain's daemon (SIGTERM, then SIGKILL after `stop_timeout`) and remove its
        directory. Raises ImexError if it does not end."""
        name = self.domain_name(domain_uid)
        pid = self.pid(domain_uid)
        if pid is not None:
            self._signal(pid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout
            while self.pid(domain_uid) is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.pid(domain_uid) is not None:
                self._signal(pid, signal.SIGKILL)
                time.sleep(0.1)
                if self.pid(domain_uid) is not None:
                    raise ImexError(f"the IMEX daemon of domain {domain_uid} (pid {pid}) does not end")
            log.info("IMEX daemon stopped", domain_uid=domain_uid, pid=pid)
        shutil.rmtree(self.dirs(domain_uid).base, ignore_errors=True)
        if name is not None:
            self._left.append((domain_uid, *name))

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)  # its own session: the daemon and what it forked
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


__all__ = ["CONTROL_BINARY", "DAEMON_BINARY", "MARKER_ENV", "ImexDaemons", "ImexError", "daemon_config"]
