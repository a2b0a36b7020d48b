"""CEL device selectors evaluated as the scheduler does: cel-expr-python (Google's cel-cpp)
with the Kubernetes functions DRA selectors use (`quantity`, `semver`, `compareTo`, ...).

The environment is the one of k8s.io/dynamic-resource-allocation/cel: a variable `device`
with `driver`, `attributes[domain].id`, `capacity[domain].id` and
`allowMultipleAllocations`; attribute names without a domain are the driver's; version
attributes are semver values and capacities are quantities; a domain the device does not
have is an empty map. cel-expr-python has no Kubernetes types, so a quantity is the map
{"q": "80Gi"} and a semver {"v": "1.2.3"}, with member functions on such maps; a domain the
expression names is filled in with an empty map (cel-cpp fails on a missing key).

Not covered (an expression that needs them evaluates to an error, which is reported):
the IP/CIDR, URL, authz and format libraries. The cost limit is not enforced.
It must NOT read anything or keep state beyond the compiled-expression cache.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Final, cast

from dra_driver.jsontypes import JSON

_DOMAIN_LOOKUP: Final = re.compile(r"""\b(?:attributes|capacity)\s*\[\s*(["'])([^"']+)\1\s*\]""")
_SEMVER: Final = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?"
)
_LOOSE_SEMVER: Final = re.compile(r"v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(.*)")


class CelError(Exception):
    """An expression that does not compile or does not evaluate to a bool."""


@dataclass(frozen=True)
class Outcome:
    matches: bool
    error: str | None = None  # a runtime error: the scheduler stops allocating on this node


# --------------------------------------------------------------------------- quantities


@functools.cache
def _client_parser() -> Callable[[object], Any]:
    """The Kubernetes client's `parse_quantity`, loaded from its own file. Importing
    `kubernetes.utils.quantity` runs the `kubernetes` and `kubernetes.utils` packages' __init__,
    which import the whole client and its config loader: most of the CPU of a `why` run that
    evaluates a quantity, for one function that imports only `decimal`."""
    loaded = sys.modules.get("kubernetes.utils.quantity")
    if loaded is not None:
        return cast(Callable[[object], Any], loaded.parse_quantity)
    package = importlib.util.find_spec("kubernetes")  # finds it without importing it
    if package is None or not package.submodule_search_locations:
        raise ModuleNotFoundError("the kubernetes client is not installed (pip install kubernetes)")
    path = Path(package.submodule_search_locations[0]) / "utils" / "quantity.py"
    spec = importlib.util.spec_from_file_location("dra_driver.explain._client_quantity", path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"the kubernetes client has no quantity parser at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return cast(Callable[[object], Any], module.parse_quantity)


def parse_quantity(value: object) -> Decimal:
    """A Kubernetes quantity ("80Gi", "100m", 3) as a Decimal (the client's parser)."""
    return Decimal(_client_parser()(value))


def format_quantity(value: Decimal) -> str:
    """A plain number string that parse_quantity reads back exactly."""
    return str(int(value)) if value == value.to_integral_value() else format(value.normalize(), "f")


def _q(value: Mapping[str, str]) -> Decimal:
    return parse_quantity(value["q"])


def _cmp(a: Decimal | tuple[Any, ...], b: Decimal | tuple[Any, ...]) -> int:
    return (a > b) - (a < b)  # type: ignore[operator]


# --------------------------------------------------------------------------- semver


def _semver_key(text: str) -> tuple[int, int, int, tuple[tuple[int, int | str], ...] | None]:
    match = _SEMVER.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not a semantic version")
    pre = match[4]
    parts = (
        tuple((0, int(p)) if p.isdigit() else (1, p) for p in pre.split("."))  # numeric ids sort first
        if pre
        else None
    )
    return int(match[1]), int(match[2]), int(match[3]), parts


def _semver_order(text: str) -> tuple[Any, ...]:
    major, minor, patch, pre = _semver_key(text)
    # A release sorts after its pre-releases.
    return (major, minor, patch, (1,) if pre is None else (0, pre))


def normalize_semver(text: str) -> str:
    """What `semver(s, true)` accepts: a leading v, missing minor or patch, leading zeros."""
    match = _LOOSE_SEMVER.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not a semantic version")
    major, minor, patch, rest = match.groups()
    return f"{int(major)}.{int(minor or 0)}.{int(patch or 0)}{rest}"


def _semver(text: str, normalize: bool = False) -> dict[str, str]:
    value = normalize_semver(text) if normalize else text
    _semver_key(value)
    return {"v": value}


def _is_semver(text: str, normalize: bool = False) -> bool:
    try:
        _semver(text, normalize)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------- member functions


def _compare(a: Mapping[str, str], b: Mapping[str, str]) -> int:
    if "q" in a and "q" in b:
        return _cmp(_q(a), _q(b))
    if "v" in a and "v" in b:
        return _cmp(_semver_order(a["v"]), _semver_order(b["v"]))
    raise ValueError("compareTo: both sides must be quantities, or both semvers")


def _part(index: int) -> Any:
    return lambda v: _semver_key(v["v"])[index]


def _is_quantity(text: str) -> bool:
    try:
        parse_quantity(text)
    except ValueError:
        return False
    return True


@functools.cache
def _env() -> Any:
    # a compiled extension (no py.typed), imported only where CEL runs
    from cel_expr_python import cel  # type: ignore[import-untyped]
    from cel_expr_python.ext import ext_bindings, ext_optional, ext_strings  # type: ignore[import-untyped]

    t = cel.Type
    obj = t.Map(t.STRING, t.STRING)

    def fn(name: str, *overloads: tuple[str, Any, list[Any], bool, Any]) -> Any:
        return cel.FunctionDecl(
            name,
            [
                cel.Overload(oid, return_type=ret, parameters=params, is_member=member, impl=impl)
                for oid, ret, params, member, impl in overloads
            ],
        )

    decls = [
        fn("quantity", ("k8s_quantity", obj, [t.STRING], False, lambda s: (parse_quantity(s), {"q": s})[1])),
        fn("isQuantity", ("k8s_is_quantity", t.BOOL, [t.STRING], False, _is_quantity)),
        fn(
            "semver",
            ("k8s_semver", obj, [t.STRING], False, _semver),
            ("k8s_semver_normalize", obj, [t.STRING, t.BOOL], False, _semver),
        ),
        fn(
            "isSemver",
            ("k8s_is_semver", t.BOOL, [t.STRING], False, _is_semver),
            ("k8s_is_semver_normalize", t.BOOL, [t.STRING, t.BOOL], False, _is_semver),
        ),
        fn("compareTo", ("k8s_compare_to", t.INT, [obj, obj], True, _compare)),
        fn("isGreaterThan", ("k8s_greater", t.BOOL, [obj, obj], True, lambda a, b: _compare(a, b) > 0)),
        fn("isLessThan", ("k8s_less", t.BOOL, [obj, obj], True, lambda a, b: _compare(a, b) < 0)),
        fn(
            "add",
            ("k8s_q_add", obj, [obj, obj], True, lambda a, b: {"q": format_quantity(_q(a) + _q(b))}),
            ("k8s_q_add_int", obj, [obj, t.INT], True, lambda a, b: {"q": format_quantity(_q(a) + b)}),
        ),
        fn(
            "sub",
            ("k8s_q_sub", obj, [obj, obj], True, lambda a, b: {"q": format_quantity(_q(a) - _q(b))}),
            ("k8s_q_sub_int", obj, [obj, t.INT], True, lambda a, b: {"q": format_quantity(_q(a) - b)}),
        ),
        fn("sign", ("k8s_q_sign", t.INT, [obj], True, lambda a: _cmp(_q(a), Decimal(0)))),
        fn(
            "isInteger",
            ("k8s_q_is_integer", t.BOOL, [obj], True, lambda a: _q(a) == _q(a).to_integral_value()),
        ),
        fn("asInteger", ("k8s_q_as_integer", t.INT, [obj], True, lambda a: int(_q(a)))),
        fn("asApproximateFloat", ("k8s_q_as_float", t.DOUBLE, [obj], True, lambda a: float(_q(a)))),
        fn("major", ("k8s_semver_major", t.INT, [obj], True, _part(0))),
        fn("minor", ("k8s_semver_minor", t.INT, [obj], True, _part(1))),
        fn("patch", ("k8s_semver_patch", t.INT, [obj], True, _part(2))),
    ]
    extensions = [ext_strings.ExtStrings(), ext_optional.ExtOptional(), ext_bindings.ExtBindings()]
    return cel.NewEnv(variables={"device": t.DYN}, extensions=extensions, functions=decls)


@dataclass(frozen=True)
class Program:
    expression: str
    compiled: Any
    domains: tuple[str, ...]  # the domains the expression looks up, filled in when missing


@functools.lru_cache(maxsize=1024)
def compile_selector(expression: str) -> Program:
    """The compiled selector; CelError says what is wrong with it."""
    try:
        compiled = _env().compile(expression)
    except Exception as e:  # cel-cpp reports every compile problem as a plain exception
        raise CelError(f"CEL selector {expression!r} does not compile: {e}") from None
    domains = tuple(sorted({m[2] for m in _DOMAIN_LOOKUP.finditer(expression)}))
    return Program(expression, compiled, domains)


def _attribute_value(value: JSON) -> Any:
    if "version" in value:
        return {"v": value["version"]}
    if "versions" in value:
        return [{"v": v} for v in value["versions"]]
    for kind in ("string", "int", "bool", "strings", "ints", "bools"):
        if kind in value:
            return value[kind]
    return None


def _qualified(name: str, driver: str) -> tuple[str, str]:
    domain, _, ident = name.rpartition("/")
    return (domain or driver), ident


def device_variable(driver: str, device: JSON, multiple_allocations: bool = True) -> JSON:
    """The CEL `device` variable of one slice device (v1 JSON), as the scheduler builds it."""
    attributes: dict[str, dict[str, Any]] = {}
    for name, value in (device.get("attributes") or {}).items():
        domain, ident = _qualified(name, driver)
        attributes.setdefault(domain, {})[ident] = _attribute_value(value)
    capacity: dict[str, dict[str, Any]] = {}
    for name, value in (device.get("capacity") or {}).items():
        domain, ident = _qualified(name, driver)
        capacity.setdefault(domain, {})[ident] = {"q": str(value.get("value", "0"))}
    variable: JSON = {"driver": driver, "attributes": attributes, "capacity": capacity}
    if multiple_allocations:
        variable["allowMultipleAllocations"] = bool(device.get("allowMultipleAllocations"))
    return variable


def evaluate(program: Program, variable: JSON) -> Outcome:
    """Whether the device (from `device_variable`) matches; a runtime error is not a match."""
    data = variable
    missing = [d for d in program.domains if d not in variable["attributes"] or d not in variable["capacity"]]
    if missing:
        data = {
            **variable,
            "attributes": {**{d: {} for d in missing}, **variable["attributes"]},
            "capacity": {**{d: {} for d in missing}, **variable["capacity"]},
        }
    try:
        result = program.compiled.eval(data={"device": data})
    except Exception as e:  # an exception raised by a shim function
        return Outcome(False, f"{program.expression!r}: {e}")
    value = result.value()
    if isinstance(value, bool):
        return Outcome(value)
    if result.type().name().lower() == "error":
        return Outcome(False, f"{program.expression!r}: {value}")
    return Outcome(False, f"{program.expression!r} returned {value!r}, not a bool")
