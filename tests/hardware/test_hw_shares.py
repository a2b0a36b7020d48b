"""6. Memory shares on the real H200: two share claims of the one GPU, prepared by the
driver's own transaction (`NodePreparer` with `Sharing` and `MpsControl`), each with its own
MPS control daemon; two CUDA clients in containers made from the claims' CDI specs run AT
THE SAME TIME as uid 65534. Share A has 10Gi, share B 20Gi: A allocates 8 GiB and B 15 GiB
and both hold it while the other does; then A fails at 12 GiB and B at 25 GiB, each against
its own limit. Unprepare of A leaves B's daemon running; unprepare of B leaves no MPS
process on the host.

The claims are what the scheduler writes for shares (`shareID`, `consumedCapacity`); the
scheduler's side is proven in tests/integration/test_memory_shares.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hwutil import DRIVER, NODE, WORKLOAD_PYTHON, Recorder, make_preparer, mps_processes, run, smi
from hwworkloads import last_json

from dra_driver.devices import node_devices
from dra_driver.plugin.claims import ClaimRef
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.mps.layout import default_root
from dra_driver.sharing.shares import share_views
from tests.harness import container as ctr

pytestmark = [pytest.mark.hardware, pytest.mark.container]

GI = 2**30
A = ClaimRef("default", "share-a", "5a0c1a55-0000-4000-8000-00000000000a")
B = ClaimRef("default", "share-b", "5a0c1a55-0000-4000-8000-00000000000b")
# (claim, consumed memory, allocation that must work, allocation that must fail), in GiB
PLAN = ((A, 10, 8, 12), (B, 20, 15, 25))
HOLD_SECONDS = 15  # long enough to overlap whatever torch's start-up takes in each

# Allocate BELOW GiB and hold it HOLD seconds (the other client runs meanwhile), free it,
# then allocate ABOVE GiB: one JSON line with what happened and when.
SHARE_CLIENT = r"""
import json, os, time
below, above, hold = (int(os.environ[k]) for k in ("SHARE_BELOW_GIB", "SHARE_ABOVE_GIB", "SHARE_HOLD_S"))
out = {"uid": os.getuid(), "env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS")}}
try:
    import torch
    free, total = torch.cuda.mem_get_info()
    out["mem_get_info_gib"] = [round(free / 2**30, 2), round(total / 2**30, 2)]
    x = torch.empty(below * 2**30, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
    out[f"alloc_{below}gib"] = "ok"
    out["holding_from"] = time.time()
    time.sleep(hold)  # not a wait: the client holds its memory this long
    out["holding_until"] = time.time()
    del x
    torch.cuda.empty_cache()
except Exception as e:
    out[f"alloc_{below}gib"] = f"{type(e).__name__}: {str(e)[:400]}"
try:
    y = torch.empty(above * 2**30, dtype=torch.uint8, device="cuda")
    y.fill_(1)
    torch.cuda.synchronize()
    out[f"alloc_{above}gib"] = "ok"
except Exception as e:
    out[f"alloc_{above}gib"] = f"{type(e).__name__}: {str(e)[:400]}"
print(json.dumps(out))
"""


def share_claim(ref: ClaimRef, gib: int) -> dict[str, Any]:
    """A claim as the API server returns it once the scheduler allocated a share of gpu-0."""
    result = {
        "request": "mem",
        "driver": DRIVER,
        "pool": NODE,
        "device": "gpu-0-share",
        "shareID": f"{ref.uid[:-4]}5ea{ref.uid[-1]}",
        "consumedCapacity": {"memory": f"{gib}Gi"},
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "mem",
                        "exactly": {
                            "deviceClassName": "gpu-share.gpu.dra-driver.dev",
                            "capacity": {"requests": {"memory": f"{gib}Gi"}},
                        },
                    }
                ]
            }
        },
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


def _logs(mps: MpsControl, ref: ClaimRef) -> str:
    return "\n".join(
        f"--- {ref.name} {p.name} ---\n{p.read_text(errors='replace')[-2500:]}"
        for p in sorted(mps.dirs(ref.uid).log.glob("*.log"))
    )


def test_two_shares_of_one_gpu_each_hold_their_own_limit(
    tmp_path: Path,
    inventory: Any,
    driver_files: Any,
    driver_root: str,
    container_options: ctr.ContainerOptions,
    record: Recorder,
) -> None:
    mps = MpsControl(os.environ.get("HW_MPS_ROOT") or default_root(DRIVER), driver_root)
    devices = node_devices(inventory)
    devices.update(share_views(devices))
    claims = [share_claim(ref, gib) for ref, gib, _, _ in PLAN]
    preparer = make_preparer(tmp_path, inventory, driver_files, *claims, mps=mps, devices=devices)
    asyncio.run(preparer.recover())
    results = asyncio.run(preparer.prepare([A, B]))
    try:
        for ref, _, _, _ in PLAN:
            assert results[ref.uid].error is None, results[ref.uid].error
        specs = {ref.uid: next((tmp_path / "cdi").glob(f"*{ref.uid}*.json")) for ref, _, _, _ in PLAN}
        envs = {
            uid: json.loads(p.read_text())["devices"][0]["containerEdits"]["env"] for uid, p in specs.items()
        }
        daemons = {ref.name: mps.daemon_pids(ref.uid) for ref, _, _, _ in PLAN}
        record(
            "shares-prepare",
            f"NodePreparer.prepare([{A}, {B}]) with allocations {[c['status'] for c in claims]}",
            "\n".join(f"{p.name}: env {envs[uid]}" for uid, p in specs.items()),
            note=f"daemon processes per claim: {daemons}; share ids answered: "
            f"{[d.share_id for r in results.values() for d in r.devices]}; mps processes: {mps_processes()}",
        )
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10G" in envs[A.uid]
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20G" in envs[B.uid]
        assert daemons[A.name] and daemons[B.name] and not set(daemons[A.name]) & set(daemons[B.name])

        cdi_specs = ctr.load_cdi_specs([tmp_path / "cdi"])
        during: list[str] = []
        stop = threading.Event()

        def watch() -> None:  # what the host sees while both clients hold their memory
            time.sleep(HOLD_SECONDS / 2 + 3)  # not a wait: a sample in the middle of the hold
            if not stop.is_set():
                apps = run(
                    [smi(driver_root), "--query-compute-apps=pid,process_name,used_memory", "--format=csv"]
                )
                during.append(apps.stdout + apps.stderr)
                during.append("\n".join(mps_processes()))

        def client(ref: ClaimRef, below: int, above: int) -> ctr.ContainerResult:
            ids = tuple(i for d in results[ref.uid].devices for i in d.cdi_device_ids)
            edits = ctr.edits_from_cdi(cdi_specs, ids).with_env(
                f"SHARE_BELOW_GIB={below}", f"SHARE_ABOVE_GIB={above}", f"SHARE_HOLD_S={HOLD_SECONDS}"
            )
            return ctr.run_container(
                edits, [WORKLOAD_PYTHON, "-c", SHARE_CLIENT], container_options, timeout=240
            )

        with ThreadPoolExecutor(3) as pool:
            watcher = pool.submit(watch)
            futures = {ref: pool.submit(client, ref, below, above) for ref, _, below, above in PLAN}
            outputs = {ref: f.result() for ref, f in futures.items()}
            stop.set()
            watcher.result()
        record(
            "shares-clients",
            "[two containers at once, uid 65534, each from its claim's CDI spec] python3 -c SHARE_CLIENT",
            "\n\n".join(f"### {ref.name}\n{outputs[ref].describe()}" for ref, _, _, _ in PLAN),
            note="nvidia-smi --query-compute-apps and MPS processes while both held memory:\n"
            + "\n".join(during),
        )
        record(
            "shares-daemon-logs",
            "cat <mps root>/<claim>/log/*.log",
            "\n".join(_logs(mps, r) for r, *_ in PLAN),
        )
        out = {ref: last_json(outputs[ref].stdout) for ref, _, _, _ in PLAN}
        for ref, _, below, above in PLAN:
            o = out[ref]
            assert o["uid"] == 65534, o
            assert o[f"alloc_{below}gib"] == "ok", (ref.name, o)
            assert "out of memory" in o[f"alloc_{above}gib"].lower(), (ref.name, o)
        overlap_from = max(out[ref]["holding_from"] for ref, *_ in PLAN)
        overlap_until = min(out[ref]["holding_until"] for ref, *_ in PLAN)
        assert overlap_from < overlap_until, f"the clients did not hold their memory at the same time: {out}"

        # A client cannot raise its own limit: the daemon's default is what its server enforces.
        ids = tuple(i for d in results[A.uid].devices for i in d.cdi_device_ids)
        raised = ctr.run_container(
            ctr.edits_from_cdi(cdi_specs, ids).with_env(
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40G",
                "SHARE_BELOW_GIB=8",
                "SHARE_ABOVE_GIB=12",
                "SHARE_HOLD_S=0",
            ),
            [WORKLOAD_PYTHON, "-c", SHARE_CLIENT],
            container_options,
            timeout=240,
        )
        record(
            "shares-client-raises-its-limit",
            "[container uid 65534, share-a's spec + CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40G] "
            "python3 -c SHARE_CLIENT",
            raised.describe(),
        )
        assert "out of memory" in last_json(raised.stdout)["alloc_12gib"].lower()

        # The plugin restarts (a new process: its own MpsControl and preparer on the same
        # node dirs): recovery adopts both daemons (same PIDs, same dirs), and a new client
        # of share B still gets B's limit.
        before = {ref.name: mps.daemon_pids(ref.uid) for ref, *_ in PLAN}
        mps = MpsControl(mps.root, driver_root)
        preparer = make_preparer(tmp_path, inventory, driver_files, *claims, mps=mps, devices=devices)
        asyncio.run(preparer.recover())
        after = {ref.name: mps.daemon_pids(ref.uid) for ref, *_ in PLAN}
        again = client(B, 15, 25)
        record(
            "shares-client-after-plugin-restart",
            "[new MpsControl + NodePreparer, recover(); then a container of share-b, uid 65534] "
            "python3 -c SHARE_CLIENT",
            f"daemon processes before {before}, after {after}\n{again.describe()}",
        )
        assert after == before, "the restarted plugin adopts the daemons it did not start"
        after_restart = last_json(again.stdout)
        assert after_restart["alloc_15gib"] == "ok", after_restart
        assert "out of memory" in after_restart["alloc_25gib"].lower(), after_restart

        asyncio.run(preparer.unprepare([A]))
        after_a = (mps.daemon_pids(A.uid), mps.daemon_pids(B.uid))
        record(
            "shares-unprepare-a",
            f"NodePreparer.unprepare([{A}])",
            f"share-a processes left: {list(after_a[0])}\nshare-b processes: {list(after_a[1])}\n"
            f"mps processes: {mps_processes()}",
        )
        assert not after_a[0] and after_a[1], "unprepare of one share must stop its daemon only"
    finally:
        asyncio.run(preparer.unprepare([A, B]))
    for _ in range(100):
        if not mps_processes():
            break
        time.sleep(0.1)  # the poll interval (10 s at most)
    record(
        "shares-unprepare",
        f"NodePreparer.unprepare([{A}, {B}]); then look for MPS processes",
        f"nvidia-cuda-mps-* processes left: {mps_processes()}\n"
        f"claim dirs left: {[r.name for r, *_ in PLAN if mps.dirs(r.uid).base.exists()]}\n"
        f"CDI specs left: {list((tmp_path / 'cdi').glob('*.json'))}",
    )
    assert not mps_processes()
    assert not any(mps.dirs(r.uid).base.exists() for r, *_ in PLAN)
