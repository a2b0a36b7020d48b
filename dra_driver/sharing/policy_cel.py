"""Writes the chart's claim-config admission policy from the rules table.

`render()` returns deploy/helm/gpu-dra-driver/templates/claim-config-policy.yaml: a skeleton
(policy_skeleton.yaml beside this module: the Helm and YAML around the rules, the checks of
apiVersion, kind and strategy, and the claim-wide rules over requests and classes) whose
`<<name>>` markers are filled with CEL made from `dra_driver.sharing.rules`: every object's
allowed fields and its unknown-field refusal, and every field's value check with its reason.
`make policy` writes the file (`python -m dra_driver.sharing.policy_cel --write`);
tests/unit/test_claim_policy_generated.py fails when the chart's file is not what this renders.

It must not decide anything the table does not say: a rule changes in rules.py (or, for a
claim-wide rule, in the skeleton), never in the chart's file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Final

from dra_driver.sharing import rules
from dra_driver.sharing.rules import MAX_MEMORY, MIN_MEMORY, NVIDIA, Check, Field

SKELETON: Final = Path(__file__).with_name("policy_skeleton.yaml")
CHART_FILE: Final = (
    Path(__file__).resolve().parents[2] / "deploy/helm/gpu-dra-driver/templates/claim-config-policy.yaml"
)
_MARKER = re.compile(r"<<([a-z_]+):([a-z]+):([A-Za-z.]*)>>")
_PATH: Final = "opaque.parameters"
_BINARY: Final = {2**20: "1Mi", 2**30: "1Gi", 2**40: "1Ti"}


def _string(text: str) -> str:
    """A CEL string literal."""
    return json.dumps(text, ensure_ascii=False)


def _var(parent: str) -> str:
    return "p" + "".join(f".{part}" for part in parent.split(".") if part)


def _path(parent: str) -> str:
    return _PATH + "".join(f".{part}" for part in parent.split(".") if part)


def _escaped(value: str) -> str:
    """A value echoed in a message, its line breaks written as repr() writes them (the API
    server drops a message that holds one)."""
    return f'{value}.replace("\\n", "\\\\n").replace("\\r", "\\\\r")'


def repr_cel(value: str) -> str:
    """Python's repr() of a string, int, bool or None, in CEL."""
    return (
        f'({value} == null ? "None" : type({value}) == string ? "\'" + {_escaped(value)} + "\'" : '
        f'type({value}) == int ? string({value}) : type({value}) == bool ? ({value} ? "True" : "False") : '
        '"a value of another type")'
    )


def unknown_cel(form: str, parent: str, indent: str) -> str:
    """`cond ? message :` refusing a field the object does not have: the first in code-point
    order and how many more, as config.check_fields words it."""
    var, names = _var(parent), rules.allowed(form, parent)
    listed = "[" + ", ".join(_string(n) for n in names) + "]"
    bad = f"{var}.filter(k, !(k in {listed}))"
    if form == NVIDIA and parent == "sharing":  # the fields of each kind (MIG has no timeSlicingConfig)
        by_kind = [", ".join(rules.allowed(form, parent, kind)) for kind in (rules.GPU_KIND, rules.MIG_KIND)]
        tail = (f'(p.kind == {_string(rules.GPU_KIND)} ? {_string("; allowed: " + by_kind[0])} : '
                f'{_string("; allowed: " + by_kind[1])})')
    else:
        tail = _string("; allowed: " + ", ".join(names))
    message = (
        f'{_string(_path(parent) + ": unknown field")} + (size({bad}) > 1 ? "s \'" : " \'") + '
        f'{_escaped(f"{bad}.filter(k, {bad}.all(j, k <= j))[0]")} + "\'" + '
        f'(size({bad}) > 1 ? " and " + string(size({bad}) - 1) + " more" : "") + {tail}'
    )
    return f"{var}.exists(k, !(k in {listed})) ?\n{indent}{message} :"


def memory_ok(value: str) -> str:
    """A quantity from MIN_MEMORY to MAX_MEMORY, as config.memory_quantity reads one."""
    low, high = _BINARY[MIN_MEMORY], _BINARY[MAX_MEMORY]
    return (
        f"(type({value}) == int && {value} >= {MIN_MEMORY} && {value} <= {MAX_MEMORY}) || "
        f"(type({value}) == string && isQuantity({value}) && "
        f"quantity({value}).compareTo(quantity({_string(low)})) >= 0 "
        f"&& quantity({value}).compareTo(quantity({_string(high)})) <= 0)"
    )


def value_cel(field: Field, indent: str) -> str:
    """`cond ? message :` for one row's check (config.check_value in CEL)."""
    v = f"{_var(field.parent)}.{field.name}"
    present = f"{_var(field.parent)}.?{field.name}.orValue(null) != null"
    path = f"{_path(field.parent)}.{field.name}"
    if field.check is Check.PERCENTAGE:
        bad = f"{present} && !(type({v}) == int && {v} >= 1 && {v} <= 100)"
        if field.echo:
            message = f"{_string(path + ': ')} + {repr_cel(v)} + {_string(' ' + field.reason)}"
        elif field.zero_reason:
            message = (f"{_string(path + ': ')} + (type({v}) == int && {v} == 0 ? "
                       f"{_string(field.zero_reason)} : {_string(field.reason)})")
        else:
            message = _string(f"{path}: {field.reason}")
        return f"{bad} ?\n{indent}{message} :"
    if field.check is Check.MEMORY:
        return f"{present} && !({memory_ok(v)}) ?\n{indent}{_string(f'{path}: {field.reason}')} :"
    if field.check is Check.MEMORY_MAP:
        keys = 'k.matches("^[0-9]+$") || k.matches("^(GPU|MIG)-[0-9A-Za-z-]+$")'
        bad = f"{present} && (type({v}) != map || {v}.exists(k, !({keys}) || !({memory_ok(f'{v}[k]')})))"
        return f"{bad} ?\n{indent}{_string(f'{path}: {field.reason}')} :"
    if field.check is Check.FALSE:
        return (f"{present} && type({v}) != bool ? {_string(f'{path}: {field.reason}')} :\n"
                f"{indent[:-2]}{_var(field.parent)}.?{field.name}.orValue(false) == true ? "
                f"{_string(f'{path}: {field.true_reason}')} :")
    if field.check is Check.DEFAULT:
        return f'{present} && {v} != "Default" ?\n{indent}{_string(f"{path}: {field.reason}")} :'
    raise ValueError(f"{field.name}: a STRUCTURE row has no value check")


def values_cel(form: str, parent: str, indent: str) -> str:
    """Every row of one object, chained in the table's order."""
    return f"\n{indent[:-2]}".join(value_cel(f, indent) for f in rules.values(form, parent))


def validations_cel(indent: str) -> str:
    """The policy's validations, one per RULES row in its order: the first refusal of each."""
    first = {
        rules.Shape.MESSAGES: ("size(variables.{v}) == 0", "string(variables.{v}[0])"),
        rules.Shape.PER_SLOT: ("variables.{v}.all(l, size(l) == 0)", "string(variables.{v}[0][0])"),
        rules.Shape.PER_CONFIG: (
            'variables.{v}.all(e, e == "")', 'string(variables.{v}.filter(e, e != "")[0])'
        ),
    }
    out = []
    for rule in rules.RULES:
        check, message = (t.format(v=rule.variable) for t in first[rule.shape])
        out.append(f"- expression: {check}\n{indent}messageExpression: {message}\n{indent}reason: Invalid")
    return f"\n{indent[:-2]}".join(out)


def _fill(match: re.Match[str], indent: str) -> str:
    what, form, parent = match.groups()
    if what == "validations":
        return validations_cel(indent)
    if what == "unknown":
        return unknown_cel(form, parent, indent)
    if what == "values":
        return values_cel(form, parent, indent)
    raise ValueError(f"unknown marker {match.group(0)}")


def render(skeleton: str | None = None) -> str:
    """The chart's claim-config policy: the skeleton with every marker filled. A marker's
    continuation lines are indented two spaces more than the marker's own line."""
    text = SKELETON.read_text() if skeleton is None else skeleton
    out = []
    for line in text.splitlines(keepends=True):
        match = _MARKER.search(line)
        if match is None:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()) + 2)
        out.append(line[: match.start()] + _fill(match, indent) + line[match.end():])
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {CHART_FILE} (default: print)")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        CHART_FILE.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
