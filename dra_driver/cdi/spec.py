"""CDI (Container Device Interface) spec data types and the rules on their names and versions.

The kubelet hands the container runtime fully-qualified CDI device ids
(`vendor/class=name`); the runtime looks them up in spec files and applies their container
edits. This module is the model of such a file, as the CDI library's `specs-go` package:

* the frozen dataclasses `CdiSpec`, `Device`, `ContainerEdits`, `DeviceNode`, `Mount`, `Hook`;
* `minimum_version`: every spec declares the lowest `cdiVersion` its content needs,
  because a runtime whose CDI library predates the declared version rejects the whole file;
* the name rules: vendor, class, device name, claim UID, qualified ids.

It must NOT decide what a container gets (that is `dra_driver.cdi.builders`), serialize
or touch files (`dra_driver.cdi.files`), or import anything of the plugin: pure data and
validation only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Final

from dra_driver import DEFAULT_DRIVER_NAME
from dra_driver.names import MAX_SUBDOMAIN_LENGTH, is_dns_subdomain

DEFAULT_VENDOR: Final = DEFAULT_DRIVER_NAME
CDI_CLASS: Final = "gpu"

KNOWN_VERSIONS: Final = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")


class CdiNameError(ValueError):
    """A vendor, class, device name or claim UID that CDI (or a file name) cannot carry."""


# --------------------------------------------------------------------------- data model


@dataclass(frozen=True)
class DeviceNode:
    """`containerEdits.deviceNodes[]`. `path` is inside the container."""

    path: str
    host_path: str | None = None  # needs cdiVersion 0.5.0
    type: str | None = None  # "c", "b", "u", "p"
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None  # permission bits, written as a JSON number
    permissions: str | None = None  # cgroup access, default "rwm"
    uid: int | None = None
    gid: int | None = None


@dataclass(frozen=True)
class Mount:
    """`containerEdits.mounts[]`."""

    host_path: str
    container_path: str
    options: tuple[str, ...] = ()
    type: str | None = None  # needs cdiVersion 0.4.0


@dataclass(frozen=True)
class Hook:
    """`containerEdits.hooks[]` (modelled for completeness; this driver writes none)."""

    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None


@dataclass(frozen=True)
class ContainerEdits:
    """`containerEdits`: what the runtime adds to the container's OCI spec."""

    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()
    additional_gids: tuple[int, ...] = ()  # needs cdiVersion 0.7.0

    def merged(self, other: ContainerEdits) -> ContainerEdits:
        """Both edits, this one's entries first (the runtime lets a later env key win)."""
        return ContainerEdits(
            env=self.env + other.env,
            device_nodes=self.device_nodes + other.device_nodes,
            mounts=self.mounts + other.mounts,
            hooks=self.hooks + other.hooks,
            additional_gids=self.additional_gids + other.additional_gids,
        )

    @cached_property
    def cdi_version(self) -> str:
        """`edits_minimum_version`, worked out once per object (the edits every claim's spec
        shares are one object, scanned for each spec otherwise)."""
        return edits_minimum_version(self)


@dataclass(frozen=True)
class Device:
    """`devices[]`: one CDI device; `name` is the part after `=` in its qualified id."""

    name: str
    container_edits: ContainerEdits
    annotations: tuple[tuple[str, str], ...] = ()  # needs cdiVersion 0.6.0


@dataclass(frozen=True)
class CdiSpec:
    """One CDI spec file. Its `cdiVersion` is derived from the content, never chosen."""

    kind: str
    devices: tuple[Device, ...]
    container_edits: ContainerEdits = field(default_factory=ContainerEdits)
    annotations: tuple[tuple[str, str], ...] = ()  # needs cdiVersion 0.6.0
    # Not part of the file's content: the claim a transient spec belongs to, which names
    # its file (`write_spec`). None for the static spec.
    claim_uid: str | None = None

    @property
    def cdi_version(self) -> str:
        return minimum_version(self)

    @property
    def vendor(self) -> str:
        return self.kind.partition("/")[0]

    @property
    def cdi_class(self) -> str:
        return self.kind.partition("/")[2]

    def qualified_ids(self) -> tuple[str, ...]:
        return tuple(f"{self.kind}={d.name}" for d in self.devices)


# --------------------------------------------------------------------------- versions


def _all_edits(spec: CdiSpec) -> Iterable[ContainerEdits]:
    yield spec.container_edits
    for d in spec.devices:
        yield d.container_edits


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def edits_minimum_version(edits: ContainerEdits) -> str:
    """The lowest cdiVersion whose schema holds these container edits."""
    if edits.additional_gids:
        return "0.7.0"
    if any(n.host_path for n in edits.device_nodes):
        return "0.5.0"
    if any(m.type for m in edits.mounts):
        return "0.4.0"
    return "0.3.0"


def newest_version(*versions: str) -> str:
    return max(versions, key=_version_key)


def minimum_version(spec: CdiSpec) -> str:
    """The lowest cdiVersion whose schema holds everything `spec` uses (0.3.0 at least): the
    newest that any part needs, as the CDI library's specs-go/version.go decides it (0.7.0
    additional GIDs; 0.6.0 annotations or a '.' in the class; 0.5.0 a device name starting
    with a digit or a device node with a host path; 0.4.0 a mount type)."""
    if spec.annotations or any(d.annotations for d in spec.devices) or "." in spec.cdi_class:
        own = "0.6.0"
    elif any(d.name[:1].isdigit() for d in spec.devices):
        own = "0.5.0"
    else:
        own = "0.3.0"
    return newest_version(own, *(e.cdi_version for e in _all_edits(spec)))


# --------------------------------------------------------------------------- names

_CLAIM_UID = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,126}[A-Za-z0-9])?")


_VENDOR_OR_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")


def _check_vendor_or_class(what: str, name: str) -> None:
    if _VENDOR_OR_CLASS.fullmatch(name):
        return
    if not name:
        raise CdiNameError(f"CDI {what} is empty")
    if not name[0].isascii() or not name[0].isalpha():
        raise CdiNameError(f"CDI {what} {name!r} must start with a letter")
    if not name[-1].isascii() or not name[-1].isalnum():
        raise CdiNameError(f"CDI {what} {name!r} must end with a letter or digit")
    bad = [c for c in name[1:-1] if not (c.isascii() and (c.isalnum() or c in "_.-"))]
    if bad:
        raise CdiNameError(f"CDI {what} {name!r} may not contain {bad[0]!r}")


def validate_vendor(vendor: str) -> None:
    """A CDI vendor that is also a DNS subdomain (the driver name is one)."""
    _check_vendor_or_class("vendor", vendor)
    if len(vendor) > MAX_SUBDOMAIN_LENGTH:
        raise CdiNameError(f"CDI vendor {vendor!r} is longer than {MAX_SUBDOMAIN_LENGTH} characters")
    if not is_dns_subdomain(vendor):
        raise CdiNameError(
            f"CDI vendor {vendor!r} is not a DNS subdomain (lower-case labels of a-z, 0-9, '-')"
        )


def validate_class(cdi_class: str) -> None:
    _check_vendor_or_class("class", cdi_class)
    if len(cdi_class) > 63:
        raise CdiNameError(f"CDI class {cdi_class!r} is longer than 63 characters")


def validate_device_name(name: str) -> None:
    if _DEVICE_NAME.fullmatch(name):
        return
    if not name:
        raise CdiNameError("CDI device name is empty")
    if not (name[0].isascii() and name[0].isalnum()) or not (name[-1].isascii() and name[-1].isalnum()):
        raise CdiNameError(f"CDI device name {name!r} must start and end with a letter or digit")
    bad = [c for c in name if not (c.isascii() and (c.isalnum() or c in "_.:-"))]
    if bad:
        raise CdiNameError(f"CDI device name {name!r} may not contain {bad[0]!r}")


def is_claim_uid(text: str) -> bool:
    """Whether `text` can be a claim UID here: it prefixes a CDI device name and sits in a file name."""
    return bool(_CLAIM_UID.fullmatch(text))


def validate_claim_uid(claim_uid: str) -> None:
    """A claim UID that can prefix a CDI device name and sit in a file name."""
    if not is_claim_uid(claim_uid):
        raise CdiNameError(
            f"claim UID {claim_uid!r} is not usable in a CDI device or file name "
            "(letters, digits, '.', '_', '-'; at most 128 characters)"
        )


def kind_for(vendor: str = DEFAULT_VENDOR) -> str:
    validate_vendor(vendor)
    return f"{vendor}/{CDI_CLASS}"


def qualified_name(vendor: str, cdi_class: str, name: str) -> str:
    """`vendor/class=name`, validated."""
    validate_vendor(vendor)
    validate_class(cdi_class)
    validate_device_name(name)
    return f"{vendor}/{cdi_class}={name}"


def claim_device_name(claim_uid: str, device_name: str) -> str:
    """The CDI device name of one allocated device of one claim: `<claimUID>-<device>`."""
    validate_claim_uid(claim_uid)
    name = f"{claim_uid}-{device_name}"
    validate_device_name(name)
    return name


def claim_device_id(vendor: str, claim_uid: str, device_name: str) -> str:
    """The qualified id the kubelet passes to the runtime, e.g. `gpu.dra-driver.dev/gpu=<uid>-gpu-0`."""
    return qualified_name(vendor, CDI_CLASS, claim_device_name(claim_uid, device_name))
