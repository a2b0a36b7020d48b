"""CDI specs; the module is becoming a package (spec, builders, files): see dra_driver.cdi.spec."""

from dra_driver.cdi.spec import *  # noqa: F403
