"""CUDA MPS (Multi-Process Service) control daemons, one per claim that asks for MPS sharing.

One module per job:

    settings       what a claim's daemon is started with, its limits, the clients' variables (pure)
    layout         the claim's directories under the MPS root and the rules the root must meet
    daemon         `MpsControl`: start, command and stop the daemons; the containers' CDI edits
    adoption       what a restarted plugin finds: the root's owner, saved settings, processes
    compute_modes  exclusive-process mode for whole-GPU claims, recorded and put back
    errors         MpsError and the refusals of an MPS root

The mount and namespace system calls are `dra_driver.sharing.mounts` (shared with the
launcher, `dra_driver.sharing.mps_launch`). Import from the module that does the job: this
file re-exports nothing.
"""
