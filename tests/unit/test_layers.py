"""The layers of the product code (dra_driver/, controller/), read from the source with `ast`,
and what may import the demo.

The layers, lowest first (LAYERS; units of one layer are separated by commas):

    dra_driver (the package itself: the default driver name and the version)
    names, atomic, log, jsontypes, signals, kubeletapi   know nothing of GPUs or claims
    gpu, driver_root, kube, metrics,   the node's GPUs and driver files, the API client, the metrics,
      explain                          the scheduler's allocator replayed on API objects
    devices                            the GPUs as allocatable devices
    cdi, health
    sharing, probes, imex              imex: ComputeDomains' channels and IMEX daemons
    plugin, controller
    node                               the daemon assembled: plugin and controller joined
    commands
    cli
    __main__

* a module imports only its own unit and the units of lower layers: an import that climbs
  (gpu importing health) or goes sideways (cdi importing health: the units of one layer do
  not know each other) is a defect;
* every product module is in a unit, so a new module is given its place here;
* no import cycle among the modules;
* nothing in the product imports `tests`, `demo` or `benchmarks` (the wheel holds only
  dra_driver and controller), and nothing in tests/ or benchmarks/ imports `demo` except
  the tests of the demo itself (`test_demo*.py`): their cluster helpers are tests.harness.

Every import in a module counts, inside functions and under TYPE_CHECKING too: a lazy
import is still a dependency. `from a.b import c` depends on the module a.b.c if there is
one, else on a.b (as import-linter counts). The rules first run on a small made-up tree
with one violation of each, so a check that silently stopped matching fails as well.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("dra_driver", "controller")
OUTSIDE_THE_WHEEL = ("tests", "demo", "benchmarks")
DEMO_USERS = ("tests", "benchmarks")  # may not import `demo`, except the demo's own tests
# Lowest first. A unit is a module or a package with all its modules; the bare root
# `dra_driver` is its __init__ only (ROOT_ONLY), so every other module must be listed.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("dra_driver",),
    (
        "dra_driver.names",
        "dra_driver.atomic",
        "dra_driver.log",
        "dra_driver.jsontypes",
        "dra_driver.signals",
        "dra_driver.kubeletapi",
    ),
    ("dra_driver.gpu", "dra_driver.driver_root", "dra_driver.kube", "dra_driver.metrics",
     "dra_driver.explain"),
    ("dra_driver.devices",),
    ("dra_driver.cdi", "dra_driver.health"),
    ("dra_driver.sharing", "dra_driver.probes", "dra_driver.imex"),
    ("dra_driver.plugin", "controller"),
    ("dra_driver.node",),
    ("dra_driver.commands",),
    ("dra_driver.cli",),
    ("dra_driver.__main__",),
)
ROOT_ONLY = "dra_driver"
RANK = {unit: rank for rank, layer in enumerate(LAYERS) for unit in layer}


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


def unit_of(name: str) -> str | None:
    """The longest unit of LAYERS that is the module or a package above it; None: unplaced."""
    units = [u for u in RANK if name == u or (u != ROOT_ONLY and name.startswith(u + "."))]
    return max(units, key=len, default=None)


def unplaced(modules: Mapping[str, Module]) -> list[str]:
    return sorted(m.path for m in modules.values() if unit_of(m.name) is None)


def _crossings(modules: Mapping[str, Module]) -> Iterator[tuple[str, str, int, int]]:
    """(module, imported module, rank of the module's unit, rank of the imported one) of every
    import from one unit into another."""
    for m in modules.values():
        mine = unit_of(m.name)
        for imported in sorted(m.imports):
            target = _target(imported, modules)
            theirs = unit_of(target) if target is not None else None
            if mine is not None and theirs is not None and target is not None and theirs != mine:
                yield m.name, target, RANK[mine], RANK[theirs]


def climbs(modules: Mapping[str, Module]) -> list[str]:
    """`module -> imported` for each import of a higher layer by a lower one."""
    return sorted({f"{a} -> {b}" for a, b, mine, theirs in _crossings(modules) if theirs > mine})


def sideways(modules: Mapping[str, Module]) -> list[str]:
    """`module -> imported` for each import between two units of one layer."""
    return sorted({f"{a} -> {b}" for a, b, mine, theirs in _crossings(modules) if theirs == mine})


def outside_importers(modules: Mapping[str, Module]) -> dict[str, list[str]]:
    """Product modules that import tests, demo or benchmarks, with what they import."""
    found = {m.path: sorted(i for i in m.imports if _top(i) in OUTSIDE_THE_WHEEL) for m in modules.values()}
    return {path: imports for path, imports in sorted(found.items()) if imports}


def demo_importers(modules: Mapping[str, Module]) -> dict[str, list[str]]:
    """Modules of tests/ and benchmarks/ that import the demo, except the demo's own tests."""
    found = {
        m.path: sorted(i for i in m.imports if _top(i) == "demo")
        for m in modules.values()
        if not Path(m.path).name.startswith("test_demo")
    }
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
            "dra_driver/gpu/__init__.py": "",
            "dra_driver/gpu/model.py": "",
            "dra_driver/gpu/a.py": "from dra_driver.gpu import b\n",
            # a lazy import counts, and one under TYPE_CHECKING
            "dra_driver/gpu/b.py": "def f() -> None:\n    from dra_driver.gpu.a import x\n",
            "dra_driver/gpu/sub/__init__.py": "from .m import y\n",
            "dra_driver/gpu/sub/m.py": "from ..a import z\nfrom . import n\n",
            "dra_driver/gpu/sub/n.py": "",
            "dra_driver/gpu/sim/fake_nvml.py": "from dra_driver.health import events\n",
            "dra_driver/devices.py": "if TYPE_CHECKING:\n    import dra_driver.sharing\n",
            "dra_driver/health/__init__.py": "",
            "dra_driver/health/events.py": "from dra_driver.gpu import model\n",
            "dra_driver/cdi/__init__.py": "from dra_driver.health.events import Event\n",
            "dra_driver/sharing/__init__.py": "",
            "dra_driver/sharing/policy.py": "from dra_driver.plugin import state\n",
            "dra_driver/plugin/__init__.py": "",
            "dra_driver/plugin/state.py": "import controller.publisher\n",
            "dra_driver/new_module.py": "",
            "dra_driver/cli.py": "import controller\n",
            "dra_driver/commands/__init__.py": "",
            "dra_driver/commands/run.py": "from controller import plan\nfrom dra_driver import cli\n",
            "controller/__init__.py": "",
            "controller/plan.py": "from tests.harness import objects\nfrom dra_driver import NAME\n",
            "controller/publisher.py": "import benchmarks.run\nfrom controller import plan\n",
            "tests/harness/objects.py": "from dra_driver import names\n",
            "tests/node/test_pods.py": "from demo.run import get_pod\n",
            "tests/unit/test_demo_report.py": "from demo.report import render\n",
            "benchmarks/node.py": "import demo\n",
        },
    )
    modules = read_modules(tmp_path)
    assert modules["dra_driver.gpu.sub.m"].imports == {"dra_driver.gpu.a.z", "dra_driver.gpu.sub.n"}
    assert import_graph(modules)["dra_driver.gpu.sub"] == {"dra_driver.gpu.sub.m"}
    assert cycles(import_graph(modules)) == [["dra_driver.gpu.a", "dra_driver.gpu.b"]]
    assert unplaced(modules) == ["dra_driver/new_module.py"]
    assert climbs(modules) == [
        "dra_driver.commands.run -> dra_driver.cli",
        "dra_driver.devices -> dra_driver.sharing",
        "dra_driver.gpu.sim.fake_nvml -> dra_driver.health.events",
        "dra_driver.sharing.policy -> dra_driver.plugin.state",
    ]
    assert sideways(modules) == [
        "dra_driver.cdi -> dra_driver.health.events",
        "dra_driver.plugin.state -> controller.publisher",
    ]
    assert outside_importers(modules) == {
        "controller/plan.py": ["tests.harness.objects"],
        "controller/publisher.py": ["benchmarks.run"],
    }
    assert demo_importers(read_modules(tmp_path, DEMO_USERS)) == {
        "benchmarks/node.py": ["demo"],
        "tests/node/test_pods.py": ["demo.run.get_pod"],
    }


# ---------------------------------------------------------------- the product code


def test_the_product_code_is_read() -> None:
    modules = read_modules(REPO)
    assert {"dra_driver.cli", "dra_driver.cdi", "controller.publisher", "controller.plan"} <= set(modules)
    assert {"tests.harness.objects", "benchmarks.node"} <= set(read_modules(REPO, DEMO_USERS))


def test_every_module_has_a_layer() -> None:
    found = unplaced(read_modules(REPO))
    assert not found, f"{found} belong to no unit of LAYERS: give each its place there (lowest that works)"


def test_no_import_cycles() -> None:
    found = cycles(import_graph(read_modules(REPO)))
    assert not found, f"import cycles (each list: modules that import one another round a loop): {found}"


def test_nothing_in_the_wheel_imports_tests_demo_or_benchmarks() -> None:
    found = outside_importers(read_modules(REPO))
    assert not found, f"product modules import what is not in the wheel: {found}"


def test_no_layer_imports_a_higher_one() -> None:
    found = climbs(read_modules(REPO))
    assert not found, f"lower layers import higher ones (see LAYERS): {found}"


def test_the_units_of_one_layer_do_not_import_each_other() -> None:
    found = sideways(read_modules(REPO))
    assert not found, (
        f"units of one layer import each other (see LAYERS): {found}; move what both need to a lower layer"
    )


def test_tests_and_benchmarks_take_cluster_helpers_from_the_harness() -> None:
    found = demo_importers(read_modules(REPO, DEMO_USERS))
    assert not found, f"{found} import the demo; take the helpers from tests.harness (the demo builds on it)"
