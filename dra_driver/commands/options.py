"""Click options shared by the commands that run against a cluster."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_DRIVER_NAME = "gpu.dra-driver.dev"


def cluster_options(f: F) -> F:
    for option in reversed(
        [
            click.option(
                "--driver-name",
                default=DEFAULT_DRIVER_NAME,
                show_default=True,
                help="The DRA driver name (a DNS subdomain); also the CDI vendor.",
            ),
            click.option(
                "--kubeconfig",
                type=click.Path(dir_okay=False),
                default=None,
                help="Kubeconfig file; default: in-cluster service account, then ~/.kube/config.",
            ),
            click.option(
                "--simulate",
                metavar="NAME|PATH",
                default=None,
                help="Simulated hardware profile instead of NVML (dra-driver inventory --list-profiles).",
            ),
            click.option(
                "--list-attributes",
                type=click.Choice(["auto", "on", "off"]),
                default="auto",
                show_default=True,
                help="Publish list-type attributes (DRAListTypeAttributes); auto detects.",
            ),
        ]
    ):
        f = option(f)
    return f
