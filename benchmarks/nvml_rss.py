"""What NVML adds to a process's memory, step by step, on this machine's GPUs.

Method: a fresh interpreter (the chart's MALLOC_ARENA_MAX) reads its own VmRSS/RssAnon/
RssFile from /proc after each step the plugin takes with NVML: `import pynvml`, `nvmlInit`,
a handle and the queries discovery makes of every GPU (name, UUID, memory, PCI info), the
CUDA driver version (NVML asks libcuda: whether that loads it is recorded), an
event set with every supported event registered for every GPU (the health monitor), one
second's wait on it, and `nvmlShutdown`. Each step's figure is the process's total then, so
the differences say what each step added. Then what the health monitor's NVML calls cost
(`calls`: wall and CPU per call through pynvml, the event waits with no event pending).
Without NVML it says so and measures nothing.

Run alone: `python -m benchmarks.nvml_rss` (figures as JSON on stdout, written to
benchmarks/results/nvml_rss.json); on the GPU host `H200_BENCH=nvml_rss` (hack/h200/run.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from benchmarks import report
from benchmarks.prepare import _charted_env

STEPS = r"""
import json, re
def rss():
    s = open("/proc/self/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", s).group(1)) for k in ("VmRSS", "RssAnon", "RssFile")}
steps = [("interpreter", rss())]
import pynvml
steps.append(("import pynvml", rss()))
try:
    pynvml.nvmlInit()
except pynvml.NVMLError as e:
    print(json.dumps({"error": f"nvmlInit: {e}"})); raise SystemExit(0)
steps.append(("nvmlInit", rss()))
count = pynvml.nvmlDeviceGetCount()
handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
for h in handles:
    pynvml.nvmlDeviceGetName(h); pynvml.nvmlDeviceGetUUID(h)
    pynvml.nvmlDeviceGetMemoryInfo(h); pynvml.nvmlDeviceGetPciInfo_v3(h)
steps.append((f"handles and queries of {count} GPUs", rss()))
def libcuda_mapped():
    return any("libcuda" in line for line in open("/proc/self/maps"))
cuda_before = libcuda_mapped()
pynvml.nvmlSystemGetCudaDriverVersion_v2()
steps.append(("nvmlSystemGetCudaDriverVersion_v2 (discovery's cudaDriverVersion)", rss()))
libcuda = {"before": cuda_before, "after": libcuda_mapped()}
events = pynvml.nvmlEventSetCreate()
for h in handles:
    try:
        pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlDeviceGetSupportedEventTypes(h), events)
    except pynvml.NVMLError:
        pass
steps.append(("event set, every supported event registered", rss()))
try:
    pynvml.nvmlEventSetWait_v2(events, 1000)
except pynvml.NVMLError:
    pass
steps.append(("one 1 s event wait", rss()))
import time
def timed(call, n):
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        try:
            call()
        except pynvml.NVMLError:
            pass
    return {"n": n, "wall_ms_per_call": round((time.perf_counter() - wall) / n * 1000, 3),
            "cpu_ms_per_call": round((time.process_time() - cpu) / n * 1000, 3)}
h = handles[0]
field = [getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", 1)]
calls = {
    "nvmlEventSetWait_v2, 1000 ms, no event": timed(lambda: pynvml.nvmlEventSetWait_v2(events, 1000), 5),
    "nvmlEventSetWait_v2, 100 ms, no event": timed(lambda: pynvml.nvmlEventSetWait_v2(events, 100), 20),
    "nvmlDeviceGetMemoryInfo": timed(lambda: pynvml.nvmlDeviceGetMemoryInfo(h), 50),
    "nvmlDeviceGetFieldValues (recovery action)": timed(
        lambda: pynvml.nvmlDeviceGetFieldValues(h, field), 50),
}
pynvml.nvmlEventSetFree(events)
pynvml.nvmlShutdown()
steps.append(("nvmlShutdown", rss()))
print(json.dumps({"gpus": count, "steps": [{"step": s, **v} for s, v in steps], "calls": calls,
                  "libcuda_mapped_by_the_cuda_version_query": libcuda}))
"""


def run() -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **_charted_env()})
    if done.returncode != 0:
        raise RuntimeError(f"the NVML steps failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    report("nvml_rss", run())


if __name__ == "__main__":
    main()
