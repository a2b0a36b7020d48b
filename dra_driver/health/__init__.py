"""Device health: NVML events -> severity -> taints, health-stream status and Events, and recovery.

Layers, pure first:
- `events`: the records (NVML events, periodic probes);
- `classify`: event -> severity (overrides, NVML's recovery action, the XID table);
- `state`: the per-device recovery state machine (conditions, quiet period, history);
- `effects`: state -> taints and health-stream status; event -> devices;
- `keeper`: the event loop's owner of all device states, which others follow;
- `monitor`: the NVML thread (events and probes), the same on pynvml and FakeNvml;
- `history`, `notify`: the history file and the Kubernetes Events;
- `node`: starting and stopping all of it in the node process.
Nothing here imports the kubelet plugin or the slice publisher: the command wiring joins them.
The simulated event source is `dra_driver.gpu.sim.events`, beside the simulated GPU.
"""
