"""No test sleeps before an assertion (docs/development.md): a sleep long enough on an idle
machine is too short on a loaded one. A test waits on the state its assertion reads
(tests/harness/objects.py: `wait_for`, `wait_for_async`), and a check that something does
*not* happen watches a window for it (`watch_for`, `watch_for_async`), which ends early on a
violation and covers all of the window.

What this finds: a `time.sleep`/`asyncio.sleep` statement after which, in the same block, an
`assert` (or a block holding one) comes before any wait. Sleeps in poll loops, in helpers that
stand in for a slow peer, or last in their block are not before an assertion and pass.

The one way to keep such a sleep: it *is* the check, a window in which nothing may happen or
the time passing is itself the input, and no state can say so. Mark its line with
`# absence window:` and the reason, and name it in ABSENCE_WINDOWS below, so that each one is
a decision someone made, counted here.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
MARKER = "# absence window:"
SLEEPS = {"sleep"}  # time.sleep, asyncio.sleep, or either imported bare
WAITS = {"wait_for", "wait_for_async", "watch_for", "watch_for_async", "wait", "wait_until", "join"}

# (path under tests/, enclosing function) of each marked sleep kept before an assertion.
ABSENCE_WINDOWS: set[tuple[str, str]] = set()


def _called(node: ast.AST) -> str | None:
    if isinstance(node, ast.Await):
        node = node.value
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _is_sleep(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and _called(stmt.value) in SLEEPS


def _waits(stmt: ast.stmt) -> bool:
    return any(_called(n) in WAITS for n in ast.walk(stmt) if isinstance(n, (ast.Call, ast.Await)))


def _asserts(stmt: ast.stmt) -> bool:
    return any(isinstance(n, ast.Assert) for n in ast.walk(stmt))


def _blocks(tree: ast.AST) -> list[tuple[str, list[ast.stmt]]]:
    """Every statement list in the module, with the name of the function that holds it."""
    found: list[tuple[str, list[ast.stmt]]] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                found.append((function, block))
        for handler in getattr(node, "handlers", []):
            found.append((function, handler.body))
        for case in getattr(node, "cases", []):
            found.append((function, case.body))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found


def sleeps_before_asserts(source: str) -> list[tuple[int, str, bool]]:
    """(line, function, marked) of each sleep statement followed in its block by an assertion
    before any wait."""
    lines = source.splitlines()
    found = []
    for function, block in _blocks(ast.parse(source)):
        for i, stmt in enumerate(block):
            if not _is_sleep(stmt):
                continue
            for after in block[i + 1:]:
                if _waits(after):
                    break
                if _asserts(after):
                    found.append((stmt.lineno, function, MARKER in lines[stmt.lineno - 1]))
                    break
    return found


def _scan() -> tuple[list[str], set[tuple[str, str]]]:
    unmarked, marked = [], set()
    for path in sorted(TESTS.rglob("*.py")):
        rel = str(path.relative_to(TESTS))
        for line, function, is_marked in sleeps_before_asserts(path.read_text()):
            if is_marked:
                marked.add((rel, function))
            else:
                unmarked.append(f"tests/{rel}:{line} in {function}")
    return unmarked, marked


def test_no_test_sleeps_before_an_assertion() -> None:
    unmarked, marked = _scan()
    assert not unmarked, (
        "a fixed sleep before an assertion: wait on the state the assertion reads "
        f"(tests/harness/objects.py wait_for / watch_for) instead: {unmarked}"
    )
    assert marked == ABSENCE_WINDOWS, (
        f"absence windows kept ({MARKER!r} sleeps before an assertion) are counted in "
        f"ABSENCE_WINDOWS: new {sorted(marked - ABSENCE_WINDOWS)}, gone {sorted(ABSENCE_WINDOWS - marked)}"
    )


def test_the_scan_finds_a_sleep_before_an_assertion_and_passes_a_wait_or_a_marked_window() -> None:
    found = sleeps_before_asserts(
        "import time, asyncio\n"
        "def fixed():\n"
        "    time.sleep(3)\n"
        "    phase = read()\n"
        "    assert phase == 'Pending'\n"
        "async def fixed_async():\n"
        "    with x:\n"
        "        await asyncio.sleep(0.1)\n"
        "        if y:\n"
        "            assert z\n"
        "def waited():\n"
        "    time.sleep(1)\n"
        "    wait_for('it', probe)\n"
        "    assert it\n"
        "def poll():\n"
        "    while not done():\n"
        "        time.sleep(0.1)  # the poll interval\n"
        "    assert done()\n"
        "def window():\n"
        f"    time.sleep(2)  {MARKER} nothing to read\n"
        "    assert nothing()\n"
    )
    assert found == [(3, "fixed", False), (8, "fixed_async", False), (20, "window", True)]
