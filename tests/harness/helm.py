"""Helm for the tests: the binary of hack/helm/build.sh against one cluster's kubeconfig.

Every call gets its own Helm home (config, cache, data) under `home`, so nothing is read
from or written to the user's ~/.config/helm, and no repository is ever contacted (the
chart is a directory). It runs commands; what they should do is for the tests to say.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Helm:
    binary: Path
    kubeconfig: Path | None
    home: Path

    def env(self) -> dict[str, str]:
        homes = ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")
        dirs = {k: str(self.home / k.lower()) for k in homes}
        env = {**os.environ, **dirs}
        if self.kubeconfig is not None:
            env["KUBECONFIG"] = str(self.kubeconfig)
        return env

    def run(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.binary), *args],
            capture_output=True,
            text=True,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            what = f"helm {' '.join(args)} exited {proc.returncode}"
            raise AssertionError(f"{what}:\n{proc.stderr}{proc.stdout}")
        return proc
