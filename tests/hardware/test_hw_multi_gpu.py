"""Several GPUs of one real host (issue 18): NVLink discovery against nvidia-smi, two claims on
two GPUs at once, and a linked pair's claim whose container sees both GPUs joined by NVLink.

Skipped where the host has fewer than two GPUs (the lent one-GPU H200 machine), and without
root/unshare for the container parts, like the rest of tests/hardware. Run on a multi-GPU
host with `make test-hardware` or `pytest tests/hardware/test_hw_multi_gpu.py`; every
command and its output is recorded for tests/hardware/RESULTS.md. Topology is only read:
nothing here enables NVLink multicast (NCCL_NVLS_ENABLE=0 is set for the container).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from hwutil import DRIVER, NODE, WORKLOAD_PYTHON, Recorder, dra_driver, make_preparer, run, simulate_args, smi
from hwworkloads import last_json

from dra_driver.cdi.files import claim_uids_in
from dra_driver.gpu.topology import nvlink_pairs, nvlink_topology
from dra_driver.plugin.claims import ClaimRef
from tests.harness import container as ctr

pytestmark = [pytest.mark.hardware]

P2P_PROBE = r"""
import json, os
out = {"uid": os.getuid()}
try:
    import torch
    n = torch.cuda.device_count()
    out["device_count"] = n
    out["uuids"] = ["GPU-" + str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]
    if n >= 2:
        out["can_access_peer"] = torch.cuda.can_device_access_peer(0, 1)
        a = torch.arange(1 << 24, dtype=torch.float32, device="cuda:0")
        b = a.to("cuda:1")
        torch.cuda.synchronize(1)
        out["p2p_copy_ok"] = bool(torch.equal(b.cpu(), a.cpu()))
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def two_or_more(inventory: Any) -> Any:
    if len(inventory.gpus) < 2:
        pytest.skip(f"this host has {len(inventory.gpus)} GPU(s); the multi-GPU checks need two or more")
    return inventory


def _smi_links(matrix: str) -> dict[tuple[int, int], int]:
    """Linked GPU pairs and their NVLink count from `nvidia-smi topo -m` (entries NV<n>)."""
    rows = [line.split() for line in matrix.splitlines() if re.match(r"^GPU\d+\s", line)]
    links: dict[tuple[int, int], int] = {}
    for row in rows:
        a = int(row[0][3:])
        for b, entry in enumerate(row[1 : 1 + len(rows)]):
            if entry.startswith("NV") and a < b:
                links[(a, b)] = int(entry[2:])
    return links


def test_nvlink_discovery_matches_nvidia_smi(two_or_more: Any, driver_root: str, record: Recorder) -> None:
    matrix = run([smi(driver_root), "topo", "-m"])
    record("multi-topo-m", "nvidia-smi topo -m", matrix.stdout)
    status = run([smi(driver_root), "nvlink", "-s"])
    record("multi-nvlink-s", "nvidia-smi nvlink -s", status.stdout[-20000:])
    inventory_cmd = [*dra_driver("inventory"), *simulate_args()]
    ours = run(inventory_cmd)
    record("multi-inventory", inventory_cmd, ours.stdout)
    assert ours.returncode == 0, ours.stderr

    expected = _smi_links(matrix.stdout)
    pairs = {(p.a, p.b): p for p in nvlink_pairs(two_or_more)}
    assert set(pairs) == set(expected), (
        f"linked pairs: driver {sorted(pairs)} vs nvidia-smi {sorted(expected)}"
    )
    for key, pair in pairs.items():
        if pair.links is not None and pair.via == "direct":
            assert pair.links == expected[key], (key, pair, expected[key])
    topology = nvlink_topology(two_or_more)
    record(
        "multi-cliques",
        "nvlink_topology(inventory): cliques, layers, domains",
        repr({"cliques": topology.cliques, "domains": topology.domains, "layers": topology.clique_layers}),
    )


def _claim(uid: str, name: str, devices: list[str]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "default", "name": name, "uid": uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpus", "driver": DRIVER, "pool": NODE, "device": d} for d in devices
                    ]
                }
            }
        },
    }


def _edits(cdi_dir: Any, devices: Any) -> ctr.Edits:
    ids = tuple(i for d in devices for i in d.cdi_device_ids)
    return ctr.edits_from_cdi(ctr.load_cdi_specs([cdi_dir]), ids)


@pytest.mark.container
def test_two_claims_on_two_gpus_each_container_sees_only_its_own(
    two_or_more: Any,
    driver_files: Any,
    container_options: ctr.ContainerOptions,
    tmp_path: Any,
    record: Recorder,
) -> None:
    a, b = two_or_more.gpus[0], two_or_more.gpus[1]
    claims = [_claim("multi-a", "multi-a", ["gpu-0"]), _claim("multi-b", "multi-b", ["gpu-1"])]
    refs = [ClaimRef("default", c["metadata"]["name"], c["metadata"]["uid"]) for c in claims]
    preparer = make_preparer(tmp_path, two_or_more, driver_files, *claims)

    async def both() -> Any:
        await preparer.recover()
        return await asyncio.gather(preparer.prepare([refs[0]]), preparer.prepare([refs[1]]))

    first, second = asyncio.run(both())
    try:
        for ref, answer, gpu in ((refs[0], first, a), (refs[1], second, b)):
            result = answer[ref.uid]
            assert result.error is None, result.error
            seen = ctr.run_container(
                _edits(tmp_path / "cdi", result.devices), ["nvidia-smi", "-L"], container_options
            )
            record(
                f"multi-{ref.name}-nvidia-smi-L",
                f"[container of claim {ref.name}] nvidia-smi -L",
                seen.describe(),
            )
            listed = [line for line in seen.stdout.splitlines() if line.startswith("GPU ")]
            assert len(listed) == 1 and gpu.uuid in listed[0], seen.stdout
    finally:
        asyncio.run(preparer.unprepare(refs))
    assert not claim_uids_in(tmp_path / "cdi", DRIVER)


@pytest.mark.container
def test_a_linked_pair_claim_sees_nvlink_and_copies_peer_to_peer(
    two_or_more: Any,
    driver_files: Any,
    container_options: ctr.ContainerOptions,
    tmp_path: Any,
    record: Recorder,
) -> None:
    linked = [p for p in nvlink_pairs(two_or_more) if p.links]
    if not linked:
        pytest.skip("no two GPUs of this host are joined by NVLink")
    pair = linked[0]
    claim = _claim("multi-pair", "multi-pair", [f"gpu-{pair.a}", f"gpu-{pair.b}"])
    ref = ClaimRef("default", "multi-pair", "multi-pair")
    preparer = make_preparer(tmp_path, two_or_more, driver_files, claim)

    async def prepare() -> Any:
        await preparer.recover()
        return (await preparer.prepare([ref]))[ref.uid]

    result = asyncio.run(prepare())
    assert result.error is None, result.error
    try:
        edits = _edits(tmp_path / "cdi", result.devices)
        options = container_options
        topo = ctr.run_container(edits, ["nvidia-smi", "topo", "-m"], options)
        record(
            "multi-pair-topo-m", f"[container of GPUs {pair.a},{pair.b}] nvidia-smi topo -m", topo.describe()
        )
        assert re.search(r"^GPU0\s+X\s+NV\d+", topo.stdout, re.M), topo.stdout
        probe = ctr.run_container(
            edits, ["env", "NCCL_NVLS_ENABLE=0", WORKLOAD_PYTHON, "-c", P2P_PROBE], options, timeout=300
        )
        record(
            "multi-pair-p2p", f"[container of GPUs {pair.a},{pair.b}] python3 -c P2P_PROBE", probe.describe()
        )
        out = last_json(probe.stdout)
        uuids = {two_or_more.gpu(pair.a).uuid, two_or_more.gpu(pair.b).uuid}
        assert out.get("device_count") == 2 and set(out["uuids"]) == uuids, out
        assert out.get("can_access_peer") and out.get("p2p_copy_ok"), out
    finally:
        asyncio.run(preparer.unprepare([ref]))
