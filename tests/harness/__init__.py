"""Test plumbing, never shipped: a real control plane, the driver as a process, a kubelet-side gRPC
client, API helpers and an OCI container runner for the hardware tier."""
