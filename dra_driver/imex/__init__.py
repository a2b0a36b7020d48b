"""IMEX channels and daemons of ComputeDomains (multi-node NVLink) on one node.

`channels`: the channel devices this node publishes, a channel claim's configuration and
what its containers get (pure). `domain`: a ComputeDomain's readiness and this node's entry in
its status (pure). `daemons`: the per-domain `nvidia-imex` daemons the kubelet plugin runs
(I/O). The plugin's Prepare uses them through `dra_driver.plugin.channel_gate`.
"""
