"""Programs run inside the test containers. Each prints one JSON line as its last line."""

from __future__ import annotations

import json
from typing import Any

# A CUDA program: device count, the device's name and UUID, a 4096x4096 fp32 matmul checked
# against float64 on the CPU, and which files libcuda / libnvidia-ml were loaded from
# (with st_dev and st_ino, to tell the CDI spec's bind mount from a host copy).
CUDA_PROBE = r"""
import json, os
out = {}
try:
    import torch
    out["device_count"] = torch.cuda.device_count()
    if out["device_count"]:
        p = torch.cuda.get_device_properties(0)
        out["name"] = p.name
        out["uuid"] = "GPU-" + str(getattr(p, "uuid", "?"))
        a = torch.randn(4096, 4096, device="cuda")
        b = a @ a
        torch.cuda.synchronize()
        ref = a[:8].double().cpu() @ a.double().cpu()
        err = float((b[:8].double().cpu() - ref).abs().max() / ref.abs().max())
        out["matmul_max_rel_err"] = err
        out["matmul_ok"] = err < 1e-2
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
libs = {}
for line in open("/proc/self/maps"):
    parts = line.split()
    if len(parts) >= 6 and ("libcuda.so" in parts[5] or "libnvidia-ml.so" in parts[5]):
        st = os.stat(parts[5])
        libs[parts[5]] = [st.st_dev, st.st_ino]
out["driver_libs"] = libs
out["uid"] = os.getuid()
print(json.dumps(out))
"""

# An MPS client: what it sees, then a 5 GiB and a 20 GiB allocation.
MPS_CLIENT = r"""
import json, os
out = {"uid": os.getuid(), "env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS")}}
try:
    import torch
    free, total = torch.cuda.mem_get_info()
    out["mem_get_info_gib"] = [round(free / 2**30, 2), round(total / 2**30, 2)]
    x = torch.empty(5 * 2**30, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
    out["alloc_5gib"] = "ok"
except Exception as e:
    out["alloc_5gib"] = f"{type(e).__name__}: {str(e)[:400]}"
try:
    y = torch.empty(20 * 2**30, dtype=torch.uint8, device="cuda")
    y.fill_(1)
    torch.cuda.synchronize()
    out["alloc_20gib"] = "ok"
except Exception as e:
    out["alloc_20gib"] = f"{type(e).__name__}: {str(e)[:400]}"
print(json.dumps(out))
"""

# Which nvidia-smi runs (path, st_dev, st_ino), then its GPU list.
NVIDIA_SMI_L = (
    'p=$(command -v nvidia-smi); echo "$p $(stat -L -c "%d %i" "$p")"; nvidia-smi -L; echo "exit=$?"'
)


def last_json(stdout: str) -> dict[str, Any]:
    """The JSON object on the last non-empty line of a program's output."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            obj: dict[str, Any] = json.loads(line)
            return obj
    raise AssertionError(f"no JSON line in output:\n{stdout}")
