"""The kubelet plugin: registration, the DRA gRPC service, prepare state, checkpoint and health."""
