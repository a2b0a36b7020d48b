"""6. The health monitor on real NVML: what the GPU offers, a minute under a CUDA workload with
no false event, and a clean stop.

The monitor runs exactly as in the plugin (`dra_driver.health.node`: the NVML thread, the
keeper on an event loop, settling every second) on `pynvml`, with the periodic check every
2 s instead of 5 so that the minute holds about 30 of them. A CUDA program (matmuls on every
GPU, `HW_HEALTH_SECONDS`, default 60) runs beside it. Everything the monitor delivered is
recorded; the test asserts that no NVML event came, every check found the GPU reachable
with no recovery action pending, every device stayed Healthy with no taint, and the
thread stopped and released NVML within a few seconds.
`HW_SIMULATE=<profile>` runs the same plumbing on FakeNvml and a CPU loop (a dry run).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from hwutil import WORKLOAD_PYTHON, Recorder
from hwworkloads import last_json

from dra_driver.devices import node_devices
from dra_driver.gpu import choose_backend
from dra_driver.health.classify import HealthPolicy
from dra_driver.health.events import HealthEvent, Probe
from dra_driver.health.monitor import WANTED
from dra_driver.health.node import start_node_health

pytestmark = pytest.mark.hardware

SECONDS = float(os.environ.get("HW_HEALTH_SECONDS", "60"))
PROBE_INTERVAL = 2.0

# Matmuls on every GPU for SECONDS; prints how many it did.
CUDA_LOAD = r"""
import json, sys, time
import torch
seconds = float(sys.argv[1])
gpus = range(torch.cuda.device_count())
xs = [torch.randn(8192, 8192, device=f"cuda:{i}", dtype=torch.bfloat16) for i in gpus]
n, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    for x in xs:
        y = x @ x
    torch.cuda.synchronize()
    n += 1
print(json.dumps({"gpus": len(xs), "rounds": n, "tflop": round(n * len(xs) * 2 * 8192**3 / 1e12, 1)}))
"""
CPU_LOAD = r"""
import json, sys, time
n, end = 0, time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    n += sum(range(10000)) > 0
print(json.dumps({"gpus": 0, "rounds": n}))
"""


def test_monitor_on_real_nvml_under_a_cuda_workload_reports_nothing_false_and_stops(
    inventory: Any, record: Recorder
) -> None:
    simulate = os.environ.get("HW_SIMULATE") or None
    devices = node_devices(inventory)
    seen: list[HealthEvent | Probe] = []

    async def scenario() -> dict[str, Any]:
        health = await start_node_health(
            inventory, devices, "gpu.dra-driver.dev", HealthPolicy(), choose_backend(simulate).nvml,
            probe_interval=PROBE_INTERVAL,
        )
        apply = health.keeper.apply

        def keep(batch: Any) -> bool:  # everything the monitor delivered, in order
            seen.extend(batch)
            return apply(batch)

        health.keeper.apply = keep  # type: ignore[method-assign]
        settle = asyncio.create_task(health.keeper.settle_forever())
        program = CPU_LOAD if simulate else CUDA_LOAD
        python = sys.executable if simulate else WORKLOAD_PYTHON
        load = await asyncio.create_subprocess_exec(
            python, "-c", program, str(SECONDS), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = await load.communicate()
        alive_age = time.monotonic() - health.monitor.alive_at
        settle.cancel()
        start = time.monotonic()
        await health.stop()
        return {
            "facts": health.keeper.facts,
            "workload_rc": load.returncode,
            "workload": out.decode(),
            "workload_err": err.decode()[-2000:],
            "stop_seconds": time.monotonic() - start,
            "alive_age": alive_age,
            "views": dict(health.keeper.views),
            "thread_alive": bool(health.monitor._thread and health.monitor._thread.is_alive()),
        }

    result = asyncio.run(scenario())
    facts = result["facts"]
    probes = [p for p in seen if isinstance(p, Probe)]
    events = [e for e in seen if isinstance(e, HealthEvent)]
    record.json(
        "health-monitor",
        f"NvmlHealthMonitor on {'FakeNvml' if simulate else 'pynvml'} for {SECONDS:.0f} s beside a workload",
        {
            "registered": {str(g): list(k) for g, k in facts.registered.items()},
            "not_offered": {str(g): list(k) for g, k in facts.unsupported.items()},
            "recovery_action_field": {str(g): v for g, v in facts.recovery_action_field.items()},
            "workload": result["workload"].strip(),
            "probes": len(probes),
            "probe_answers": sorted({(p.lost, p.recovery_action) for p in probes}),
            "events": [(e.gpu, e.label, e.count, e.recovery_action) for e in events],
            "stop_seconds": round(result["stop_seconds"], 3),
            "devices": {name: (v.healthy, v.message) for name, v in result["views"].items()},
        },
        note="registered/not_offered: the NVML event types of dra_driver.health.monitor.WANTED per GPU",
    )
    assert result["workload_rc"] == 0, result["workload_err"]
    assert last_json(result["workload"])["rounds"] > 0
    for gpu in facts.registered:
        assert set(facts.registered[gpu]) | set(facts.unsupported[gpu]) == {str(k) for k in WANTED.values()}
    assert facts.registered and all(facts.registered.values()), "no NVML event type could be registered"
    assert events == [], f"false NVML events under a healthy workload: {events}"
    expected_probes = SECONDS / PROBE_INTERVAL * len(inventory.gpus)
    assert len(probes) >= 0.8 * expected_probes, f"{len(probes)} checks in {SECONDS} s: the loop stalled"
    assert all(not p.lost and p.recovery_action in (None, 0) for p in probes), probes
    assert all(v.healthy and not v.taints for v in result["views"].values()), result["views"]
    assert result["alive_age"] < 5, "the monitor loop did not turn during the workload"
    assert result["stop_seconds"] < 5 and not result["thread_alive"]
