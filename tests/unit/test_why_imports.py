"""What `kubectl gpu why` imports: not the `kubernetes` client package, whose __init__ imports the
whole client and its config loader (most of a `why` run's CPU on the demo cluster before; the
figure is benchmarks/why_cpu.py's). The client's quantity parser is still the one used, loaded
from its own file (dra_driver.explain.celenv)."""

from __future__ import annotations

import subprocess
import sys
from decimal import Decimal

from dra_driver.explain.celenv import parse_quantity

# The commands' modules, then a selector with quantities evaluated as `why` on the demo's
# pending pod does; the kubernetes package must not be in sys.modules afterwards.
PROBE = """
import sys
import dra_driver.commands.status, dra_driver.commands.why
from dra_driver.explain.celenv import compile_selector, evaluate
device = {"driver": "gpu.dra-driver.dev", "attributes": {"gpu.dra-driver.dev": {}},
          "capacity": {"gpu.dra-driver.dev": {"memory": {"q": "80Gi"}}}}
expr = 'device.capacity["gpu.dra-driver.dev"].memory.compareTo(quantity("200Gi")) >= 0'
print(evaluate(compile_selector(expr), device).matches)
print(sorted(m for m in sys.modules if m == "kubernetes" or m.startswith("kubernetes.")))
"""


def test_why_evaluates_quantities_without_importing_the_kubernetes_client() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["False", "[]"]


def test_the_quantity_parser_is_the_clients() -> None:
    from kubernetes.utils.quantity import parse_quantity as clients

    for text in ("80Gi", "100m", "1.5", "2e3", "141Gi", 3):
        assert parse_quantity(text) == Decimal(clients(text))
