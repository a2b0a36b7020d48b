"""Container images for the test nodes, written offline as OCI image archives.

There is no registry on a test machine, so the two images the node tier needs are made
here from Debian's static binaries and imported with `ctr images import`:

* `registry.k8s.io/pause:3.10.2`, the sandbox image: `/catatonit -P` (package catatonit)
  as user 65535;
* `docker.io/library/busybox:1.37`, what the examples in deploy/examples run: busybox
  from busybox-static with every applet linked, /etc/passwd and /etc/group.

An archive is `oci-layout`, `index.json` (with the `io.containerd.image.name` and
`org.opencontainers.image.ref.name` annotations `ctr` names the image by) and, under
`blobs/sha256/`, one uncompressed layer, the config and the manifest. Everything is
deterministic (mtime 0, sorted entries), so the same inputs give the same digests.
This module only writes files: it never pulls, pushes or talks to a network, and it
does not import the archives (tests.harness.node does, into each node's containerd).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

logger = structlog.get_logger(__name__)

PAUSE_IMAGE = "registry.k8s.io/pause:3.10.2"
BUSYBOX_IMAGE = "docker.io/library/busybox:1.37"
# Debian's paths (hack/node/setup.sh); hack/h200/run.sh points them at carried copies.
CATATONIT = Path(os.environ.get("DRA_CATATONIT", "/usr/bin/catatonit"))
BUSYBOX = Path(os.environ.get("DRA_BUSYBOX", "/bin/busybox"))
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_INDEX = "application/vnd.oci.image.index.v1+json"
_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_CONFIG = "application/vnd.oci.image.config.v1+json"
_LAYER = "application/vnd.oci.image.layer.v1.tar"


@dataclass(frozen=True)
class Entry:
    """One file system entry of a layer: a directory, a regular file or a symlink."""

    path: str  # relative, no leading slash
    kind: str  # "dir" | "file" | "symlink"
    data: bytes = b""
    target: str = ""
    mode: int = 0o755


def _layer(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in sorted(entries, key=lambda e: e.path):
            info = tarfile.TarInfo(e.path)
            info.mtime = 0
            info.mode = e.mode
            if e.kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif e.kind == "symlink":
                info.type = tarfile.SYMTYPE
                info.linkname = e.target
                info.mode = 0o777
                tar.addfile(info)
            else:
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
    return buf.getvalue()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_oci_archive(path: Path, name: str, entries: list[Entry], config: dict[str, Any]) -> Path:
    """Write a one-layer image `name` (registry/repo:tag) as an OCI archive at `path`."""
    layer = _layer(entries)
    layer_digest = _digest(layer)
    config_blob = _json(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
            "history": [{"created_by": "tests.harness.images", "created": "1970-01-01T00:00:00Z"}],
            "created": "1970-01-01T00:00:00Z",
        }
    )
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": _MANIFEST,
            "config": {"mediaType": _CONFIG, "digest": _digest(config_blob), "size": len(config_blob)},
            "layers": [{"mediaType": _LAYER, "digest": layer_digest, "size": len(layer)}],
        }
    )
    tag = name.rsplit(":", 1)[1]
    index = _json(
        {
            "schemaVersion": 2,
            "mediaType": _INDEX,
            "manifests": [
                {
                    "mediaType": _MANIFEST,
                    "digest": _digest(manifest),
                    "size": len(manifest),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": tag,
                    },
                }
            ],
        }
    )
    files = {
        "oci-layout": _json({"imageLayoutVersion": "1.0.0"}),
        "index.json": index,
        **{f"blobs/sha256/{_digest(b).split(':')[1]}": b for b in (layer, config_blob, manifest)},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        for fname, data in files.items():
            info = tarfile.TarInfo(fname)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(path)
    logger.debug("image archive written", image=name, path=str(path), layer_bytes=len(layer))
    return path


def _base_dirs() -> list[Entry]:
    dirs = ["bin", "dev", "etc", "proc", "root", "sys", "usr", "usr/bin", "usr/sbin", "sbin", "var"]
    return [Entry(d, "dir") for d in dirs] + [Entry("tmp", "dir", mode=0o1777)]


def _accounts() -> list[Entry]:
    passwd = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"
    group = "root:x:0:\nnogroup:x:65534:\n"
    return [
        Entry("etc/passwd", "file", passwd.encode(), mode=0o644),
        Entry("etc/group", "file", group.encode(), mode=0o644),
    ]


def pause_archive(path: Path) -> Path:
    """The sandbox image: catatonit in pause mode (reaps, sleeps, exits on SIGTERM)."""
    entries = [Entry("catatonit", "file", CATATONIT.read_bytes()), *_base_dirs(), *_accounts()]
    config = {"Entrypoint": ["/catatonit", "-P"], "User": "65535:65535", "Env": [PATH_ENV], "WorkingDir": "/"}
    return write_oci_archive(path, PAUSE_IMAGE, entries, config)


def busybox_archive(path: Path) -> Path:
    """A busybox image: the static binary at /bin/busybox and a link for every applet."""
    listed = subprocess.run([str(BUSYBOX), "--list-full"], capture_output=True, text=True, check=True)
    applets = sorted({line.strip() for line in listed.stdout.splitlines() if line.strip()} - {"bin/busybox"})
    entries = [Entry("bin/busybox", "file", BUSYBOX.read_bytes()), *_base_dirs(), *_accounts()]
    entries += [Entry(a, "symlink", target="/bin/busybox") for a in applets]
    config = {"Cmd": ["sh"], "Env": [PATH_ENV], "WorkingDir": "/"}
    return write_oci_archive(path, BUSYBOX_IMAGE, entries, config)


def write_test_images(directory: Path) -> dict[str, Path]:
    """Both archives in `directory`; image name -> archive path."""
    return {
        PAUSE_IMAGE: pause_archive(directory / "pause.oci.tar"),
        BUSYBOX_IMAGE: busybox_archive(directory / "busybox.oci.tar"),
    }
