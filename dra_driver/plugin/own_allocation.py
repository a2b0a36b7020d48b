"""Whether a claim's allocation was made for this claim, judged from the claim alone.

kube-scheduler (v1.37.2, `bindClaim` in the dynamicresources plugin) allocates a claim
from its informer's copy; when writing it conflicts, it re-reads the claim *by name* and
writes the same allocation onto whatever claim now has that name, without comparing the
UID. A claim deleted and re-created under its name while the scheduler's copy still
shows the old one (unallocated after its pod went) thus gets the old claim's devices and
the old claim's configs: a claim that asked for nothing was once prepared with another
claim's MPS (issue 55). What the allocator copies from a claim is known, so an
allocation made for another claim shows in the claim itself:

* every result's `request` is one of the claim's requests, or `request/subrequest` of
  one of its `firstAvailable` lists (exactly one subrequest chosen per list);
* each request (or the subrequest chosen) has its results: exactly `count` for
  ExactCount, at least one for All;
* a result has `adminAccess` only if its request asked for it;
* the configs with `source: FromClaim` are exactly the claim's own `spec.devices.config`
  entries that the allocator copies, in their order: none foreign, none missing (it
  leaves out only those for subrequests not chosen, and may empty `requests` when an
  entry names every request; 1.34 and 1.35 copy an entry once per request it names).

Where both claims have the same shape, the device still shows it when the request names
one of the DeviceClasses the chart ships (`foreign_device`: a MIG slice asked, a whole GPU
given). Not checked: configs from the class (the class may have changed since) and classes
of the user's own, whose selectors only the scheduler evaluates.
Pure: no I/O; each function answers what differs, or None.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

_EXACT_COUNT = "ExactCount"
# What a device is, as the `type` attribute and the MIG classes tell them apart
GPU: Final = "a whole GPU"
MIG: Final = "a MIG device"
MIG_SLICE: Final = "a dynamic MIG slice"
SHARE: Final = "a memory share"


def shipped_classes(driver: str) -> dict[str, frozenset[str]]:
    """The kinds of device each DeviceClass of the chart (templates/deviceclasses.yaml and
    memory-shares.yaml, named after the driver) selects."""
    whole = frozenset({GPU})
    return {
        driver: whole,
        f"extended.{driver}": whole,
        f"gpu-linked.{driver}": whole,  # no selector, but only whole GPUs carry clique ids
        f"mig.{driver}": frozenset({MIG, MIG_SLICE}),
        f"mig-dynamic.{driver}": frozenset({MIG_SLICE}),
        f"gpu-share.{driver}": frozenset({SHARE}),
    }


def foreign_allocation(claim: Mapping[str, Any]) -> str | None:
    """What shows that the claim's allocation was made for another claim; None if nothing does."""
    devices = _mapping(_mapping(claim.get("spec")).get("devices"))
    allocated = _mapping(_mapping(_mapping(claim.get("status")).get("allocation")).get("devices"))
    requests = [r for r in _list(devices.get("requests")) if isinstance(r, Mapping)]
    results = [r for r in _list(allocated.get("results")) if isinstance(r, Mapping)]
    chosen = _chosen(requests, Counter(str(r.get("request", "")) for r in results))
    if isinstance(chosen, str):
        return chosen
    return _configs_differ(
        _list(devices.get("config")), [c for c in _list(allocated.get("config")) if _from_claim(c)], chosen
    ) or _admin_differs(_requests(requests), results)


def foreign_device(
    claim: Mapping[str, Any], driver: str, pool: str, kind_of: Callable[[str], str | None]
) -> str | None:
    """A device of this driver and pool whose kind (`kind_of(device name)`) the chart's class
    that its request names does not select."""
    classes = shipped_classes(driver)
    requests = _requests(_list(_mapping(_mapping(claim.get("spec")).get("devices")).get("requests")))
    allocated = _mapping(_mapping(_mapping(claim.get("status")).get("allocation")).get("devices"))
    for result in _list(allocated.get("results")):
        if not isinstance(result, Mapping) or result.get("driver") != driver or result.get("pool") != pool:
            continue
        request = str(result.get("request", ""))
        cls = str(requests.get(request, {}).get("deviceClassName", ""))
        kind = kind_of(str(result.get("device", "")))
        if cls in classes and kind is not None and kind not in classes[cls]:
            return (
                f"request {request} asks for class {cls} ({' or '.join(sorted(classes[cls]))}), the "
                f"allocation gives {result.get('device')} ({kind})"
            )
    return None


def _requests(requests: Sequence[Any]) -> dict[str, Mapping[str, Any]]:
    """Each request and subrequest by the name a result carries (`gpu`, `gpu/h200`)."""
    out: dict[str, Mapping[str, Any]] = {}
    for request in requests:
        if not isinstance(request, Mapping):
            continue
        name = str(request.get("name", ""))
        if "exactly" in request:
            out[name] = _mapping(request.get("exactly"))
        for sub in _list(request.get("firstAvailable")):
            if isinstance(sub, Mapping):
                out[f"{name}/{sub.get('name', '')}"] = sub
    return out


def _chosen(requests: Sequence[Mapping[str, Any]], counts: Counter[str]) -> list[str] | str:
    """The request names the results must carry (a request's own, or the one subrequest of its
    firstAvailable list that was chosen), each with as many results as it asks for; or what
    shows that the results were made for other requests."""
    known = _requests(requests)
    unknown = sorted(n for n in counts if n not in known)
    if unknown:
        return (
            f"it has results for request(s) {', '.join(unknown)}, which the claim does not have "
            f"(its requests: {', '.join(sorted(known)) or 'none'})"
        )
    chosen: list[str] = []
    for request in requests:
        name = str(request.get("name", ""))
        if "exactly" in request:
            names = [name]
        else:
            names = [n for n in (f"{name}/{s.get('name', '')}" for s in _list(request.get("firstAvailable"))
                                 if isinstance(s, Mapping)) if counts[n]]
            if len(names) != 1:
                return f"request {name} has results for {len(names)} of its firstAvailable subrequests, not 1"
        for n in names:
            mode = known[n].get("allocationMode", _EXACT_COUNT)
            wanted = known[n].get("count", 1) if mode == _EXACT_COUNT else None
            if (wanted is not None and counts[n] != wanted) or counts[n] == 0:
                return f"request {n} asks for {wanted or 'all'} device(s), the allocation has {counts[n]}"
        chosen += names
    return chosen


def _admin_differs(
    requests: Mapping[str, Mapping[str, Any]], results: Sequence[Mapping[str, Any]]
) -> str | None:
    admin = sorted({str(r.get("request")) for r in results if r.get("adminAccess")
                    and not requests[str(r.get("request"))].get("adminAccess")})
    if admin:
        return f"it gives adminAccess to request(s) {', '.join(admin)}, which did not ask for it"
    return None


def _configs_differ(
    own: Sequence[Any], copied: Sequence[Mapping[str, Any]], chosen: Sequence[str]
) -> str | None:
    """The copied FromClaim entries must be exactly the claim's own entries that the allocator
    copies, in order: those for every request, for one of its requests, or for a subrequest
    that was chosen. kube-scheduler 1.34 and 1.35 copy an entry once per request it names (a
    missing `break`, there since 1.37), so that form is the claim's own allocation too."""
    differs = _differs(own, _expected(own, chosen, per_request=False), copied)
    if differs is not None and _differs(own, _expected(own, chosen, per_request=True), copied) is None:
        return None
    return differs


def _expected(own: Sequence[Any], chosen: Sequence[str], per_request: bool) -> list[Mapping[str, Any]]:
    expected: list[Mapping[str, Any]] = []
    for entry in own:
        if not isinstance(entry, Mapping):
            continue
        named = set(map(str, _list(entry.get("requests"))))
        matches = sum(1 for n in chosen if n in named or n.split("/", 1)[0] in named) if named else 1
        expected += [entry] * (matches if per_request else min(matches, 1))
    return expected


def _differs(
    own: Sequence[Any], expected: Sequence[Mapping[str, Any]], copied: Sequence[Mapping[str, Any]]
) -> str | None:
    for i, entry in enumerate(copied):
        if i >= len(expected) or not _same_config(entry, expected[i]):
            driver = _mapping(entry.get("opaque")).get("driver", "?")
            return (
                f"it carries a configuration for driver {driver} (requests "
                f"{', '.join(map(str, _list(entry.get('requests')))) or 'all'}) that is not among the "
                f"claim's own {len(own)} config entr{'y' if len(own) == 1 else 'ies'}"
            )
    if len(copied) < len(expected):
        driver = _mapping(expected[len(copied)].get("opaque")).get("driver", "?")
        return (
            f"it lacks the claim's own configuration for driver {driver} (it carries {len(copied)} of "
            f"the claim's {len(expected)} config entr{'y' if len(expected) == 1 else 'ies'} for its requests)"
        )
    return None


def _same_config(copied: Mapping[str, Any], own: Any) -> bool:
    if not isinstance(own, Mapping):
        return False
    if {k: v for k, v in own.items() if k != "requests"} != {
        k: v for k, v in copied.items() if k not in ("requests", "source")
    }:
        return False
    requests = _list(copied.get("requests"))
    return not requests or requests == _list(own.get("requests"))


def _from_claim(entry: Any) -> bool:
    return isinstance(entry, Mapping) and entry.get("source") == "FromClaim"


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list) else []


__all__ = ["GPU", "MIG", "MIG_SLICE", "SHARE", "foreign_allocation", "foreign_device", "shipped_classes"]
