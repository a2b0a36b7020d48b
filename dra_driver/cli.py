"""`dra-driver`: the command line entry point. Thin: each subcommand lives in dra_driver/commands/.

A subcommand's module is imported only when that subcommand runs (or help lists it): the
node daemon must not pay at every start for the imports of the controller or the
inventory report (start-to-registered is what a kubelet restart waits on).
"""

from __future__ import annotations

import importlib
from typing import Final

import click

from dra_driver import __version__, log

# name -> "module:attribute" of the click command
SUBCOMMANDS: Final = {
    "inventory": "dra_driver.commands.inventory:inventory",
    "cdi": "dra_driver.commands.cdi:cdi",
    "compute-domain-controller": "dra_driver.commands.compute_domain_controller:compute_domain_controller",
    "claim": "dra_driver.commands.claim:claim",
    "controller": "dra_driver.commands.controller:controller",
    "kubelet-plugin": "dra_driver.commands.kubelet_plugin:kubelet_plugin",
    "status": "dra_driver.commands.status:status",
    "explain": "dra_driver.commands.why:explain_command",
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(cmd_name)
        if target is None:
            return None
        module, attribute = target.split(":")
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, click.Command)
        return command


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "DRA_DRIVER"},
)
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
