"""Paths inside a driver root or a dev root, as the host would see them: symlinks resolved
inside the root (an absolute link points into the root, not into this process's /), joins,
listings that treat a missing directory as empty.

It only reads the file system, and must not know what an NVIDIA file is.
"""

from __future__ import annotations

import os
import stat as statmod


def resolve_in_root(root: str, path: str, max_links: int = 40) -> str | None:
    """Canonical root-relative path ("/a/b") of `path` with symlinks followed as if `root`
    were "/"; None if a component is missing or links loop."""
    pending = [c for c in path.split("/") if c][::-1]
    resolved: list[str] = []
    links = 0
    while pending:
        c = pending.pop()
        if c == ".":
            continue
        if c == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = os.path.join(root, *resolved, c)
        try:
            st = os.lstat(candidate)
        except OSError:
            return None
        if not statmod.S_ISLNK(st.st_mode):
            resolved.append(c)
            continue
        links += 1
        if links > max_links:
            return None
        target = os.readlink(candidate)
        if target.startswith("/"):
            resolved = []
        pending.extend([t for t in target.split("/") if t][::-1])
    return "/" + "/".join(resolved)


def join_in_root(root: str, rel: str) -> str:
    return os.path.normpath(os.path.join(root, rel.lstrip("/")))


def listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []
