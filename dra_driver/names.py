"""The one DNS-name check: is a string a Kubernetes DNS label or DNS subdomain?

The same rules as the API server's (apimachinery `IsDNS1123Label`, `IsDNS1123Subdomain`):
a label is 1 to 63 of `a-z`, `0-9`, `-`, starting and ending with a letter or digit; a
subdomain is labels joined by `.`, 253 characters at most, with no limit of its own on
one label. Callers pass a smaller `max_length` where the API sets one (a driver name: 63).
Used for the driver name (CDI vendor, ResourceSlice driver), node and pool names, device
names and claim names.

It must NOT raise, log, or word errors: it only answers yes or no, and each caller says
in its own terms what was wrong and what to write instead. Nor must it grow other name
rules (CDI names, claim UIDs): those live with the code that owns them.
"""

from __future__ import annotations

import re
from typing import Final

MAX_LABEL_LENGTH: Final = 63
MAX_SUBDOMAIN_LENGTH: Final = 253

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def is_dns_label(name: str, max_length: int = MAX_LABEL_LENGTH) -> bool:
    """Whether `name` is an RFC 1123 DNS label (e.g. a device name `gpu-0`)."""
    return 0 < len(name) <= max_length and _LABEL.fullmatch(name) is not None


def is_dns_subdomain(name: str, max_length: int = MAX_SUBDOMAIN_LENGTH) -> bool:
    """Whether `name` is an RFC 1123 DNS subdomain (e.g. `gpu.dra-driver.dev`, a node name)."""
    return 0 < len(name) <= max_length and _SUBDOMAIN.fullmatch(name) is not None
