"""The layers of the product code (dra_driver/, controller/), read from the source with `ast`:

* no import cycle among their modules;
* nothing in dra_driver/ imports `controller` except the CLI wiring (dra_driver/cli.py and
  dra_driver/commands/), so the node-side code never depends on the slice publisher;
* nothing in either imports `tests`, `demo` or `benchmarks` (the wheel holds only
  dra_driver and controller; those are not in it);
* no climb: the layers of LAYERS import only their own layer or lower ones (the hardware
  and CDI foundations know nothing of sharing, sharing nothing of the kubelet plugin, the
  plugin nothing of the commands that wire it).

Every import in a module counts, inside functions and under TYPE_CHECKING too: a lazy
import is still a dependency. `from a.b import c` depends on the module a.b.c if there is
one, else on a.b (as import-linter counts). The rules first run on a small made-up tree
with one violation of each, so a check that silently stopped matching fails as well.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("dra_driver", "controller")
CONTROLLER_CALLERS = ("dra_driver/cli.py", "dra_driver/commands/")
OUTSIDE_THE_WHEEL = ("tests", "demo", "benchmarks")
# lowest first; a module belongs to the last layer whose prefix it starts with; unlisted: 0
LAYERS = (
    ("dra_driver", 0),  # foundations: gpu, cdi, names, kube, atomic, log, devices, driver_root
    ("dra_driver.sharing", 1),
    ("controller", 1),
    ("dra_driver.plugin", 2),
    ("dra_driver.commands", 3),
    ("dra_driver.cli", 3),
    ("dra_driver.__main__", 4),
)


@dataclass(frozen=True)
class Module:
    name: str  # dotted, e.g. dra_driver.cdi.spec (a package is its __init__)
    path: str  # relative to the root, e.g. dra_driver/cdi/spec.py
    imports: frozenset[str]  # absolute dotted names: `from a.b import c` gives a.b.c


def _module_name(rel: Path) -> str:
    parts = rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, name: str, is_package: bool) -> frozenset[str]:
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.update(base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names)
    return frozenset(found)


def read_modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            name = _module_name(rel)
            tree = ast.parse(path.read_text(), filename=str(path))
            modules[name] = Module(name, rel.as_posix(), _imports(tree, name, path.name == "__init__.py"))
    return modules


def _target(imported: str, known: Mapping[str, Module]) -> str | None:
    """The module an import depends on: the longest known prefix of the dotted name."""
    parts = imported.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def import_graph(modules: Mapping[str, Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module in modules.values():
        for imported in module.imports:
            target = _target(imported, modules)
            if target is not None and target != module.name:
                graph[module.name].add(target)
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _top(imported: str) -> str:
    return imported.partition(".")[0]


def controller_importers(modules: Mapping[str, Module]) -> list[str]:
    """Modules of dra_driver/ outside the CLI wiring that import `controller`."""
    allowed = CONTROLLER_CALLERS
    return sorted(
        m.path
        for m in modules.values()
        if m.path.startswith("dra_driver/")
        and not m.path.startswith(allowed)
        and any(_top(i) == "controller" for i in m.imports)
    )


def layer_of(name: str) -> int:
    rank = 0
    for prefix, level in LAYERS:
        package = prefix.rstrip(".")
        if name == package or name.startswith(package + "."):
            rank = level
    return rank


def climbs(modules: Mapping[str, Module]) -> list[str]:
    """`module -> imported` for each import of a higher layer by a lower one."""
    found = []
    for m in modules.values():
        for imported in sorted(m.imports):
            target = next((t for t in (imported, imported.rpartition(".")[0]) if t in modules), None)
            if target is not None and layer_of(target) > layer_of(m.name):
                found.append(f"{m.name} -> {target}")
    return sorted(found)


def outside_importers(modules: Mapping[str, Module]) -> dict[str, list[str]]:
    """Product modules that import tests, demo or benchmarks, with what they import."""
    found = {m.path: sorted(i for i in m.imports if _top(i) in OUTSIDE_THE_WHEEL) for m in modules.values()}
    return {path: imports for path, imports in sorted(found.items()) if imports}


# ---------------------------------------------------------------- the checks catch what they should


def _write(root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_find_a_violation_of_each_rule(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "dra_driver/__init__.py": "",
            "dra_driver/a.py": "from dra_driver import b\n",
            "dra_driver/b.py": "def f() -> None:\n    from dra_driver.a import x\n",  # a lazy import counts
            "dra_driver/sub/__init__.py": "from .m import y\n",
            "dra_driver/sub/m.py": "from ..a import z\nfrom . import n\n",
            "dra_driver/sub/n.py": "",
            "dra_driver/uses_controller.py": "import controller.publisher\n",
            "dra_driver/cli.py": "import controller\n",
            "dra_driver/commands/__init__.py": "",
            "dra_driver/commands/run.py": "from controller import plan\n",
            "dra_driver/sharing/__init__.py": "",
            "dra_driver/sharing/policy.py": "from dra_driver.plugin import state\n",
            "dra_driver/plugin/__init__.py": "",
            "dra_driver/plugin/state.py": "",
            "controller/__init__.py": "",
            "controller/plan.py": "from tests.harness import objects\n",
            "controller/publisher.py": "import benchmarks.run\nfrom controller import plan\n",
        },
    )
    modules = read_modules(tmp_path)
    assert modules["dra_driver.sub.m"].imports == {"dra_driver.a.z", "dra_driver.sub.n"}
    assert import_graph(modules)["dra_driver.sub"] == {"dra_driver.sub.m"}
    assert cycles(import_graph(modules)) == [["dra_driver.a", "dra_driver.b"]]
    assert controller_importers(modules) == ["dra_driver/uses_controller.py"]
    assert climbs(modules) == [
        "dra_driver.sharing.policy -> dra_driver.plugin.state",
        "dra_driver.uses_controller -> controller.publisher",
    ]
    assert outside_importers(modules) == {
        "controller/plan.py": ["tests.harness.objects"],
        "controller/publisher.py": ["benchmarks.run"],
    }


# ---------------------------------------------------------------- the product code


def test_the_product_code_is_read() -> None:
    modules = read_modules(REPO)
    assert {"dra_driver.cli", "dra_driver.cdi", "controller.publisher", "controller.plan"} <= set(modules)


def test_no_import_cycles() -> None:
    found = cycles(import_graph(read_modules(REPO)))
    assert not found, f"import cycles (each list: modules that import one another round a loop): {found}"


def test_only_the_cli_wiring_imports_the_controller() -> None:
    found = controller_importers(read_modules(REPO))
    assert not found, (
        f"{found} import `controller`; in dra_driver/ only cli.py and commands/ may "
        "(node-side code must not depend on the slice publisher): move the wiring into commands/"
    )


def test_nothing_in_the_wheel_imports_tests_demo_or_benchmarks() -> None:
    found = outside_importers(read_modules(REPO))
    assert not found, f"product modules import what is not in the wheel: {found}"


def test_no_layer_imports_a_higher_one() -> None:
    found = climbs(read_modules(REPO))
    assert not found, f"lower layers import higher ones (see LAYERS): {found}"
