"""GPU driver for Kubernetes Dynamic Resource Allocation (resource.k8s.io/v1)."""

# Also the CDI vendor. Never gpu.nvidia.com by default, so that NVIDIA's driver can run beside ours.
DEFAULT_DRIVER_NAME = "gpu.dra-driver.dev"

# The package version (pyproject.toml); recorded in what this build writes to disk.
__version__ = "0.1.0"
