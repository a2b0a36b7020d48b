"""Test harness shipped with the driver: a real control plane and a kubelet-side gRPC client."""
