"""The one DNS-name check, against the API server's own rules (apimachinery validation)."""

from __future__ import annotations

import pytest

from dra_driver import DEFAULT_DRIVER_NAME
from dra_driver.names import is_dns_label, is_dns_subdomain


@pytest.mark.parametrize("name", ["a", "0", "gpu-0", "mig-1g-10gb-3-0", "a" * 63])
def test_labels(name: str) -> None:
    assert is_dns_label(name)
    assert is_dns_subdomain(name)


@pytest.mark.parametrize(
    "name", ["", "-a", "a-", "A", "gpu_0", "gpu.0", "a" * 64, "gpu-0\n", "gpu 0", "gpü"]
)
def test_not_labels(name: str) -> None:
    assert not is_dns_label(name)


@pytest.mark.parametrize(
    "name",
    ["gpu.dra-driver.dev", "node-1", "a.b.c", "my-claim-x7k2p", "a" * 253, "a" * 100 + "." + "b" * 100],
)
def test_subdomains(name: str) -> None:
    # Kubernetes sets no limit of its own on one label of a subdomain (object names).
    assert is_dns_subdomain(name)


@pytest.mark.parametrize(
    "name",
    ["", ".a", "a.", "a..b", "a.-b", "a-.b", "GPU.example.com", "a/b", "../etc", "a" * 254, "a.b\n", "a_b"],
)
def test_not_subdomains(name: str) -> None:
    assert not is_dns_subdomain(name)


def test_a_smaller_limit_where_the_api_sets_one() -> None:
    assert is_dns_subdomain("a" * 63, 63)
    assert not is_dns_subdomain("a" * 64, 63)
    assert not is_dns_label("a" * 10, 9)


def test_the_default_driver_name_is_the_documented_one() -> None:
    """The unit tests take DRIVER from the driver (one definition); this pins its value: the
    design's contract is `gpu.dra-driver.dev`, never `gpu.nvidia.com`, so both drivers coexist."""
    assert DEFAULT_DRIVER_NAME == "gpu.dra-driver.dev"
