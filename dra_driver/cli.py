"""`dra-driver`: the command line entry point. Thin: each subcommand lives in dra_driver/commands/."""

from __future__ import annotations

import click

from dra_driver import __version__, log
from dra_driver.commands.cdi import cdi
from dra_driver.commands.controller import controller
from dra_driver.commands.inventory import inventory
from dra_driver.commands.kubelet_plugin import kubelet_plugin


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "DRA_DRIVER"})
@click.option(
    "--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"])
)
@click.option(
    "--log-format",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "json", "console"]),
    help="auto: console on a terminal, JSON otherwise (in a pod).",
)
@click.version_option(__version__, prog_name="dra-driver")
def main(log_level: str, log_format: log.LogFormat) -> None:
    """GPU driver for Kubernetes Dynamic Resource Allocation."""
    log.configure(log_level, log_format)


main.add_command(inventory)
main.add_command(cdi)
main.add_command(controller)
main.add_command(kubelet_plugin)
