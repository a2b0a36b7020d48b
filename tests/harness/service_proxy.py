"""The `kubernetes` Service for pods on the test nodes: what kube-proxy does, for one address.

A pod finds the API server at KUBERNETES_SERVICE_HOST:PORT (the ClusterIP of
`default/kubernetes`, 10.0.0.1:443 here), which the API server's certificate names. The test
control plane listens on loopback only and no kube-proxy runs, so `ServiceProxy` puts the
ClusterIP on one of the nodes' links (a pod's default route leads to this machine through
its node's bridge) and relays each TCP connection to the API server; TLS passes through
untouched. Only one ServiceProxy per ClusterIP can run on a machine at a time: a second
one says so. `stop()` removes the address again (the node reaper removes the link anyway).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
from dataclasses import dataclass, field

import structlog

logger = structlog.get_logger(__name__)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


@dataclass
class ServiceProxy:
    cluster_ip: str
    port: int
    target: tuple[str, int]
    link: str
    connections: int = 0
    _listener: socket.socket | None = None
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> ServiceProxy:
        subprocess.run(["ip", "addr", "add", f"{self.cluster_ip}/32", "dev", self.link], check=True)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # The last run's connections may linger in TIME_WAIT; a live listener still refuses us.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.cluster_ip, self.port))
        except OSError as e:
            self._del_address()
            listener.close()
            raise RuntimeError(
                f"cannot listen on {self.cluster_ip}:{self.port} ({e}): another helm node test "
                "(tests/node/test_helm.py) is running on this machine; run one at a time"
            ) from None
        listener.listen(64)
        self._listener = listener
        thread = threading.Thread(target=self._accept, name="service-proxy", daemon=True)
        thread.start()
        self._threads.append(thread)
        logger.info("kubernetes Service reachable from pods", address=f"{self.cluster_ip}:{self.port}",
                    target=f"{self.target[0]}:{self.target[1]}")
        return self

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            self.connections += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def _del_address(self) -> None:
        subprocess.run(["ip", "addr", "del", f"{self.cluster_ip}/32", "dev", self.link],
                       check=False, capture_output=True)

    def stop(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        self._del_address()
