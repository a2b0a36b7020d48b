"""CDI specs on disk: the JSON form, the file names, and the atomic writer.

* `spec_to_dict`, `spec_to_json`: a `CdiSpec` as the CDI JSON schema spells it, with its
  minimum `cdiVersion`;
* `claim_spec_filename`, `static_spec_filename`: the CDI library's naming, so that its
  tools and ours agree on which file belongs to which claim;
* `write_spec`, `remove_claim_spec`, `claim_uids_in`: the only I/O of the CDI package
  (atomic writes come from `dra_driver.atomic`).

It must NOT decide what a spec contains (`dra_driver.cdi.builders`) or hold state: every
function takes the directory it works on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import structlog

from dra_driver.atomic import write_file_atomic
from dra_driver.cdi.spec import (
    CDI_CLASS,
    DEFAULT_VENDOR,
    CdiSpec,
    ContainerEdits,
    DeviceNode,
    Hook,
    Mount,
    is_claim_uid,
    validate_claim_uid,
    validate_vendor,
)

log = structlog.get_logger(__name__)

DEFAULT_CDI_DIR: Final = "/var/run/cdi"
STATIC_CDI_DIR: Final = "/etc/cdi"
SPEC_EXTENSION: Final = ".json"


# --------------------------------------------------------------------------- JSON


def _fields(out: dict[str, Any], fields: Iterable[tuple[str, object]]) -> dict[str, Any]:
    """`out` plus each of `fields` that is set, in order: None and empty collections are left out
    (0 and "" are values), tuples are written as lists."""
    for key, value in fields:
        if value is None or (isinstance(value, (tuple, list, dict)) and not value):
            continue
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


def _edits_to_dict(e: ContainerEdits) -> dict[str, Any]:
    return _fields(
        {},
        (
            ("env", e.env),
            ("deviceNodes", [_node_to_dict(n) for n in e.device_nodes]),
            ("mounts", [_mount_to_dict(m) for m in e.mounts]),
            ("hooks", [_hook_to_dict(h) for h in e.hooks]),
            ("additionalGids", e.additional_gids),
        ),
    )


def _node_to_dict(n: DeviceNode) -> dict[str, Any]:
    return _fields(
        {"path": n.path},
        (
            ("hostPath", n.host_path),
            ("type", n.type),
            ("major", n.major),
            ("minor", n.minor),
            ("fileMode", n.file_mode),
            ("permissions", n.permissions),
            ("uid", n.uid),
            ("gid", n.gid),
        ),
    )


def _mount_to_dict(m: Mount) -> dict[str, Any]:
    return _fields(
        {"hostPath": m.host_path, "containerPath": m.container_path},
        (("options", m.options), ("type", m.type or None)),
    )


def _hook_to_dict(h: Hook) -> dict[str, Any]:
    return _fields(
        {"hookName": h.hook_name, "path": h.path},
        (("args", h.args), ("env", h.env), ("timeout", h.timeout)),
    )


def spec_to_dict(spec: CdiSpec) -> dict[str, Any]:
    """The spec as CDI's JSON object, with its minimum cdiVersion."""
    head = {"cdiVersion": spec.cdi_version, "kind": spec.kind}
    out = _fields(head, (("annotations", dict(spec.annotations)),))
    out["devices"] = [
        _fields({"name": d.name}, (("annotations", dict(d.annotations)),))
        | {"containerEdits": _edits_to_dict(d.container_edits)}
        for d in spec.devices
    ]
    return _fields(out, (("containerEdits", _edits_to_dict(spec.container_edits)),))


def spec_to_json(spec: CdiSpec) -> str:
    """The spec's file content."""
    # One line: `indent` would take json's pure-Python encoder (`jq . <file>` shows it indented).
    return json.dumps(spec_to_dict(spec)) + "\n"


# --------------------------------------------------------------------------- files (I/O)


def claim_spec_filename(vendor: str, claim_uid: str) -> str:
    """`<vendor>-<class>_<claimUID>.json`, the CDI library's transient-spec naming."""
    validate_vendor(vendor)
    validate_claim_uid(claim_uid)
    return f"{vendor}-{CDI_CLASS}_{claim_uid}{SPEC_EXTENSION}"


def static_spec_filename(vendor: str = DEFAULT_VENDOR) -> str:
    validate_vendor(vendor)
    return f"{vendor}-{CDI_CLASS}{SPEC_EXTENSION}"


def claim_spec_path(cdi_dir: Path, vendor: str, claim_uid: str) -> Path:
    return Path(cdi_dir) / claim_spec_filename(vendor, claim_uid)


def write_spec_file(path: str | os.PathLike[str], spec: CdiSpec) -> None:
    """Write `spec` to exactly `path`, atomically.

    Not fsync'd: a claim spec only matters within the boot that wrote it (the CDI dir is a
    tmpfs on most hosts, and after any reboot the checkpoint is discarded and recovery
    removes every claim spec it does not know), and the page cache keeps it whole for the
    runtime across a crash of this process. Three fsyncs per claim made a 10,000-claim
    Prepare miss the kubelet's 45 s."""
    write_file_atomic(path, spec_to_json(spec).encode(), durable=False)


def write_spec(cdi_dir: Path, spec: CdiSpec) -> Path:
    """Write `spec` atomically into `cdi_dir` under its standard name (the claim's
    transient name if it has a claim UID, else the static name); returns the path."""
    if spec.claim_uid is not None:
        name = claim_spec_filename(spec.vendor, spec.claim_uid)
    else:
        name = static_spec_filename(spec.vendor)
    path = os.path.join(cdi_dir, name)
    write_spec_file(path, spec)
    log.debug("CDI spec written", path=path, devices=list(spec.qualified_ids()))
    return Path(path)


def remove_claim_spec(cdi_dir: Path, vendor: str, claim_uid: str) -> bool:
    """Remove a claim's spec; True if there was one. Removing a missing spec is not an error."""
    path = os.path.join(cdi_dir, claim_spec_filename(vendor, claim_uid))
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    log.debug("CDI spec removed", path=path)
    return True


def claim_uids_in(cdi_dir: Path, vendor: str) -> frozenset[str]:
    """Claim UIDs that have a transient spec of this vendor in `cdi_dir` (for reconciling
    after a crash: specs whose claim is not in the checkpoint are leftovers)."""
    validate_vendor(vendor)
    prefix = f"{vendor}-{CDI_CLASS}_"
    try:
        names = os.listdir(cdi_dir)
    except FileNotFoundError:
        return frozenset()
    uids = set()
    for name in names:
        if name.startswith(prefix) and name.endswith(SPEC_EXTENSION):
            uid = name[len(prefix) : -len(SPEC_EXTENSION)]
            if is_claim_uid(uid):
                uids.add(uid)
    return frozenset(uids)
