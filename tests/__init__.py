"""Project tests; `tests.harness` is the shared plumbing (control plane, nodes, kubelet-side client)."""
