"""CUDA MPS (Multi-Process Service) control daemons, one per claim that asks for MPS sharing.

One module per job:

    settings       what a claim's daemon is started with, its limits, the clients' variables (pure)
    layout         the claim's directories under the MPS root and the rules the root must meet
    daemon         `MpsControl`: start, command and stop the daemons; the containers' CDI edits
    adoption       what a restarted plugin finds: the root's owner, saved settings, processes
    compute_modes  exclusive-process mode for whole-GPU claims, recorded and put back
    errors         MpsError and the refusals of an MPS root

The mount and namespace system calls are `dra_driver.sharing.mounts` (shared with the
launcher, `dra_driver.sharing.mps_launch`). Import from the module that does the job; the
names below stay here only for `dra_driver.node.daemon`'s imports (the last importer; once it
imports from `daemon`, `errors` and `layout`, they go). Nothing else belongs in this file.
"""

from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.mps.errors import MpsRootRefused
from dra_driver.sharing.mps.layout import default_root

__all__ = ["MpsControl", "MpsRootRefused", "default_root"]
