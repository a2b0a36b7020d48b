"""NVIDIA's DRA driver v0.5.0 as a reference to run against: its source from the Go module
proxy at test time, kept in Go's module cache (never copied into this repository)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
from pathlib import Path

MODULE = "sigs.k8s.io/dra-driver-nvidia-gpu"
VERSION = "v0.5.0"


@functools.cache
def nvidia_source() -> Path:
    """The module's directory in the Go module cache (downloaded once, then read from there)."""
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"}
    with tempfile.TemporaryDirectory() as outside_any_module:
        out = subprocess.run(["go", "mod", "download", "-json", f"{MODULE}@{VERSION}"],
                             cwd=outside_any_module, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"go mod download {MODULE}@{VERSION} failed: {out.stderr.strip()[-500:]}")
    return Path(json.loads(out.stdout)["Dir"])
