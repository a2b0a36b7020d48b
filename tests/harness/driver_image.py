"""The driver's container image and Helm, built for the node tier by the hack/ scripts.

`build_driver_image()` runs hack/image/build.sh (buildah on the repository's Dockerfile,
cached outside the repository by its inputs) and returns the OCI archive that
`Node.import_images` loads into a node's containerd; `build_helm()` runs hack/helm/build.sh.
Both print their progress on stderr as they go. This module builds and reports; it never
imports, installs or starts anything.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from dra_driver import __version__
from dra_driver.jsontypes import JSON
from tests.harness.cluster import REPO_ROOT

IMAGE_BUILD = REPO_ROOT / "hack" / "image" / "build.sh"
HELM_BUILD = REPO_ROOT / "hack" / "helm" / "build.sh"
CHART = REPO_ROOT / "deploy" / "helm" / "gpu-dra-driver"
# What `image.repository: gpu-dra-driver` (the chart's default) means to a container runtime.
IMAGE_REPOSITORY = "docker.io/library/gpu-dra-driver"
IMAGE = f"{IMAGE_REPOSITORY}:{__version__}"


@dataclass(frozen=True)
class DriverImage:
    name: str  # registry/repository:tag, as imported
    archive: Path  # OCI archive for `ctr images import`
    build_seconds: float  # this call: a cached build is a hash of the inputs

    @property
    def tag(self) -> str:
        return self.name.rsplit(":", 1)[1]


def _run_script(script: Path, what: str, env: dict[str, str] | None = None) -> Path:
    proc = subprocess.run(
        ["bash", str(script)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}); its log is above")
    return Path(proc.stdout.strip().splitlines()[-1])


def build_driver_image() -> DriverImage:
    """The image from the repository's Dockerfile (DRA_IMAGE_ARCHIVE: use that archive instead)."""
    override = os.environ.get("DRA_IMAGE_ARCHIVE")
    if override:
        return DriverImage(IMAGE, Path(override), 0.0)
    t0 = time.monotonic()
    archive = _run_script(IMAGE_BUILD, "the driver image build", {"DRA_IMAGE_NAME": IMAGE})
    return DriverImage(IMAGE, archive, time.monotonic() - t0)


def render_chart(home: Path, *sets: str, show_only: str | None = None) -> list[JSON]:
    """The chart as `helm template r` renders it with these `--set` values (`show_only`: that
    template alone); `home` keeps helm's cache and config out of the user's."""
    env = {**os.environ, **{k: str(home / k.lower())
                            for k in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")}}
    args = [a for s in sets for a in ("--set", s)] + (["--show-only", show_only] if show_only else [])
    out = subprocess.run([str(build_helm()), "template", "r", str(CHART), *args],
                         capture_output=True, text=True, check=True, env=env)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def build_helm() -> Path:
    """The helm binary (DRA_HELM: use that one instead)."""
    override = os.environ.get("DRA_HELM")
    return Path(override) if override else _run_script(HELM_BUILD, "the helm build")
