"""2-4. Prepare without an API server, the CDI spec through the real CDI library, and a
container made from that spec alone running nvidia-smi and CUDA; the same for the static
spec of `dra-driver cdi generate`.

The container (tests.harness.container) is the host's filesystem minus every driver
file outside the spec: the driver root is hidden and the host's copies under /lib are
masked, so what the workload loads can only come from the spec's mounts. That is checked,
not assumed: the libcuda the CUDA process mapped must be the driver root's file (same
st_dev and st_ino), and the nvidia-smi it ran must be the driver root's.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from hwutil import (
    DRIVER,
    WORKLOAD_PYTHON,
    Recorder,
    claim_object,
    dra_driver,
    make_preparer,
    prepare_one,
    run,
    simulate_args,
)
from hwworkloads import CUDA_PROBE, NVIDIA_SMI_L, last_json

from dra_driver.cdi.files import static_spec_filename
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.state import NodePreparer
from tests.harness import container as ctr

pytestmark = [pytest.mark.hardware, pytest.mark.container]

CLAIM_UID = "5a0c1a55-0000-4000-8000-00000000c0de"


@dataclass
class Prepared:
    preparer: NodePreparer
    ref: ClaimRef
    cdi_dir: Path
    cdi_ids: tuple[str, ...]
    result: Any


@pytest.fixture(scope="module")
def prepared(
    tmp_path_factory: pytest.TempPathFactory, inventory: Any, driver_files: Any
) -> Iterator[Prepared]:
    tmp = tmp_path_factory.mktemp("prepare")
    claim = claim_object(CLAIM_UID, "h200-claim")
    preparer = make_preparer(tmp, inventory, driver_files, claim)
    ref = ClaimRef("default", "h200-claim", CLAIM_UID)

    async def go() -> Any:
        await preparer.recover()
        return await prepare_one(preparer, ref)

    result = asyncio.run(go())
    yield Prepared(preparer, ref, tmp / "cdi", tuple(i for p in result for i in p.cdi_device_ids), result)
    asyncio.run(preparer.unprepare([ref]))
    assert not list((tmp / "cdi").glob("*.json")), "unprepare left a CDI spec behind"


def test_prepare_writes_the_cdi_spec(prepared: Prepared, inventory: Any, record: Recorder) -> None:
    specs = list(prepared.cdi_dir.glob("*.json"))
    assert len(specs) == 1
    record(
        "prepare-claim-cdi-spec",
        f"NodePreparer(driver_root=/usr/local/nvidia).prepare({prepared.ref}); cat {specs[0]}",
        specs[0].read_text(),
        note=f"prepare answered: {prepared.result}",
    )
    gpu = inventory.gpu(0)
    assert prepared.cdi_ids == (f"{DRIVER}/gpu={CLAIM_UID}-gpu-0",)
    spec = json.loads(specs[0].read_text())
    assert f"GPU_DRA_DEVICE_GPU_0_UUID={gpu.uuid}" in spec["devices"][0]["containerEdits"]["env"]
    checkpoint = prepared.preparer.steps.checkpoint_path.read_text()
    record("prepare-checkpoint", f"cat {prepared.preparer.steps.checkpoint_path}", checkpoint)
    assert '"completed"' in checkpoint


def oci_from_cdicheck(
    cdicheck: str | None, cdi_dir: Path, ids: tuple[str, ...], record: Recorder, name: str
) -> Any:
    if cdicheck is None:
        pytest.skip("cdicheck not built here (bash hack/cluster/build.sh) and $CDICHECK unset")
    cmd = [cdicheck, "-dir", str(cdi_dir), *ids]
    out = run(cmd)
    record(name, cmd, out.stdout + (f"\n--- stderr ---\n{out.stderr}" if out.stderr.strip() else ""))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def edits_for(
    cdicheck: str | None, cdi_dir: Path, ids: tuple[str, ...], record: Recorder, name: str
) -> ctr.Edits:
    """The container edits as the real CDI library injects them, checked against our own reading."""
    ours = ctr.edits_from_cdi(ctr.load_cdi_specs([cdi_dir]), ids)
    oci = oci_from_cdicheck(cdicheck, cdi_dir, ids, record, name)
    theirs = ctr.edits_from_oci(oci)
    assert {n.path: (n.major, n.minor) for n in theirs.device_nodes} == {
        n.path: (n.major, n.minor) for n in ours.device_nodes
    }
    assert {(m.source, m.destination) for m in theirs.mounts} == {
        (m.source, m.destination) for m in ours.mounts
    }
    assert set(theirs.env) == set(ours.env)
    return theirs


def test_cdicheck_accepts_and_injects(prepared: Prepared, cdicheck: str | None, record: Recorder) -> None:
    edits = edits_for(cdicheck, prepared.cdi_dir, prepared.cdi_ids, record, "cdicheck-claim")
    paths = {n.path for n in edits.device_nodes}
    assert {"/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"} <= paths
    assert any(m.destination.endswith("/libcuda.so.1") for m in edits.mounts)


def _host_file_id(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino]


def check_gpu_container(
    edits: ctr.Edits,
    options: ctr.ContainerOptions,
    inventory: Any,
    driver_files: Any,
    record: Recorder,
    label: str,
) -> None:
    """nvidia-smi -L lists exactly the allocated GPU, CUDA computes on it, and both came
    from the spec's files; then the negative controls."""
    gpu = inventory.gpu(0)
    smi_run = ctr.run_container(edits, ["sh", "-c", NVIDIA_SMI_L], options)
    record(
        f"{label}-nvidia-smi-L",
        f"[container uid 65534, {label} edits] sh -c '{NVIDIA_SMI_L}'",
        smi_run.describe(),
        note=f"setup: {_setup_summary(smi_run)}",
    )
    assert smi_run.returncode == 0, smi_run.describe()
    listed = [line for line in smi_run.stdout.splitlines() if line.startswith("GPU ")]
    assert len(listed) == 1 and gpu.uuid in listed[0], smi_run.stdout
    smi_host = next(b.host_path for b in driver_files.binaries if b.name == "nvidia-smi")
    dev, ino = _host_file_id(smi_host)
    assert smi_run.stdout.splitlines()[0] == f"/usr/bin/nvidia-smi {dev} {ino}", (
        "not the driver root's nvidia-smi"
    )

    cuda = ctr.run_container(edits, [WORKLOAD_PYTHON, "-c", CUDA_PROBE], options, timeout=180)
    libcuda_host = next(lib.host_path for lib in driver_files.libraries if "libcuda.so" in lib.host_path)
    expected_ids = {"libcuda": _host_file_id(libcuda_host), "nvidia-smi (host)": _host_file_id(smi_host)}
    record(
        f"{label}-cuda",
        f"[container uid 65534, {label} edits] python3 -c CUDA_PROBE (tests/hardware/hwworkloads.py)",
        cuda.describe(),
        note=f"host driver-root files (st_dev, st_ino): {expected_ids}",
    )
    result = last_json(cuda.stdout)
    assert result.get("device_count") == 1, result
    assert result.get("uuid") == gpu.uuid, result
    assert result.get("matmul_ok"), result
    assert result["uid"] == ctr.NOBODY
    loaded = [ids for path, ids in result["driver_libs"].items() if "libcuda.so" in path]
    assert loaded == [expected_ids["libcuda"]], (result["driver_libs"], expected_ids)

    # Negative control: the same container without the GPU's node.
    without = edits.without_device(f"/dev/nvidia{gpu.minor}")
    neg_smi = ctr.run_container(without, ["sh", "-c", NVIDIA_SMI_L], options)
    neg_cuda = ctr.run_container(without, [WORKLOAD_PYTHON, "-c", CUDA_PROBE], options, timeout=180)
    record(
        f"{label}-negative-no-nvidia0",
        f"[container uid 65534, {label} edits minus /dev/nvidia{gpu.minor}] "
        "nvidia-smi -L; python3 -c CUDA_PROBE",
        neg_smi.describe() + "\n" + neg_cuda.describe(),
    )
    assert "No devices found" in neg_smi.stdout + neg_smi.stderr
    assert last_json(neg_cuda.stdout).get("device_count") == 0


def _setup_summary(r: ctr.ContainerResult) -> str:
    s = r.setup
    return json.dumps(
        {
            "masked": s.get("masked"),
            "shadowed": s.get("shadowed"),
            "device_cgroup": s.get("device_cgroup"),
            "warnings": s.get("warnings"),
        }
    )


def test_claim_spec_container(
    prepared: Prepared,
    cdicheck: str | None,
    container_options: ctr.ContainerOptions,
    inventory: Any,
    driver_files: Any,
    record: Recorder,
) -> None:
    edits = edits_for(cdicheck, prepared.cdi_dir, prepared.cdi_ids, record, "cdicheck-claim-for-container")
    check_gpu_container(edits, container_options, inventory, driver_files, record, "claim")


def test_root_is_isolated_only_by_the_device_cgroup(
    prepared: Prepared,
    container_options: ctr.ContainerOptions,
    inventory: Any,
    record: Recorder,
) -> None:
    """As root, NVML re-creates a missing /dev/nvidia0; the device cgroup must stop that."""
    edits = ctr.edits_from_cdi(ctr.load_cdi_specs([prepared.cdi_dir]), prepared.cdi_ids)
    without = edits.without_device(f"/dev/nvidia{inventory.gpu(0).minor}")
    cmd = ["sh", "-c", NVIDIA_SMI_L + "; ls -l /dev/nvidia*"]
    no_cgroup = ctr.run_container(without, cmd, replace(container_options, user=None, device_cgroup=False))
    with_cgroup = ctr.run_container(without, cmd, replace(container_options, user=None, device_cgroup=True))
    record(
        "root-negative-control",
        "[container as ROOT, claim edits minus /dev/nvidia0] first without, then with the BPF device cgroup",
        "### without device cgroup\n"
        + no_cgroup.describe()
        + "\n### with device cgroup\n"
        + with_cgroup.describe(),
        note=f"device cgroup: {with_cgroup.setup.get('device_cgroup')}",
    )
    if not with_cgroup.setup.get("device_cgroup", {}).get("path"):
        pytest.skip(f"no cgroup v2 device filter here: {with_cgroup.setup.get('device_cgroup')}")
    assert "No devices found" in with_cgroup.stdout + with_cgroup.stderr


def test_static_spec_container(
    tmp_path: Path,
    driver_root: str,
    cdicheck: str | None,
    container_options: ctr.ContainerOptions,
    inventory: Any,
    driver_files: Any,
    record: Recorder,
) -> None:
    out = tmp_path / "cdi" / static_spec_filename(DRIVER)
    cmd = [
        *dra_driver("cdi"),
        "generate",
        "--driver-root",
        driver_root,
        "-o",
        str(out),
        *simulate_args(),
    ]
    gen = run(cmd)
    assert gen.returncode == 0, gen.stderr
    record(
        "static-cdi-spec",
        f"dra-driver cdi generate --driver-root {driver_root} -o {out}; cat {out}",
        out.read_text(),
        note=gen.stderr.strip().splitlines()[-1] if gen.stderr.strip() else "",
    )
    edits = edits_for(cdicheck, out.parent, (f"{DRIVER}/gpu=0",), record, "cdicheck-static")
    check_gpu_container(edits, container_options, inventory, driver_files, record, "static")
