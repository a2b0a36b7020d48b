"""`python -m dra_driver` is `dra-driver`."""

from dra_driver.cli import main

main()
