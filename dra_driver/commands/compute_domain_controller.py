"""`dra-driver compute-domain-controller`: keep every ComputeDomain's ResourceClaimTemplate and
status (controller/compute_domain_controller.py). One replica: it needs no leader election."""

from __future__ import annotations

import click
import structlog

from controller.compute_domain_controller import ComputeDomainController
from dra_driver import DEFAULT_DRIVER_NAME, kube
from dra_driver.signals import run_until_signalled

log = structlog.get_logger(__name__)


@click.command("compute-domain-controller")
@click.option("--driver-name", default=DEFAULT_DRIVER_NAME, show_default=True,
              help="The DRA driver name; also the ComputeDomain API group.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), default=None,
              help="Kubeconfig file; default: in-cluster service account, then ~/.kube/config.")
def compute_domain_controller(driver_name: str, kubeconfig: str | None) -> None:
    """Make each ComputeDomain's ResourceClaimTemplate and keep its status."""
    run_until_signalled(_run(driver_name, kubeconfig))


async def _run(driver: str, kubeconfig: str | None) -> None:
    api = await kube.load_client(kubeconfig)
    try:
        log.info("keeping ComputeDomains", driver=driver)
        await ComputeDomainController(api, driver).run()
    finally:
        await api.close()
