"""1. NVML discovery against nvidia-smi, and the ResourceSlice the controller would publish."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import pytest
from hwutil import DRIVER, NODE, Recorder, dra_driver, run, simulate_args, smi

from controller.slices import SliceFeatures, desired_slices
from dra_driver.gpu.nvml import normalize_pci_bus_id
from dra_driver.sharing.config import quantity_value

pytestmark = pytest.mark.hardware

MIB = 2**20
QUERY = "index,uuid,name,memory.total,pci.bus_id,driver_version,compute_cap"


def test_inventory_equals_nvidia_smi(inventory: Any, driver_root: str, record: Recorder) -> None:
    cli = [
        *dra_driver("inventory"),
        "-o",
        "json",
        *simulate_args(),
    ]
    out = run(cli)
    assert out.returncode == 0, out.stderr
    record("inventory-json", "dra-driver inventory -o json", out.stdout, note=f"run as: {cli}")
    doc = json.loads(out.stdout)

    cmd = [smi(driver_root), f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
    smi_out = run(cmd)
    assert smi_out.returncode == 0, smi_out.stderr
    record("nvidia-smi-query", cmd, smi_out.stdout)
    rows = [[c.strip() for c in row] for row in csv.reader(io.StringIO(smi_out.stdout)) if row]

    assert len(rows) == len(inventory.gpus) == len(doc["gpus"])
    compared = []
    for index, uuid, name, mem_mib, bus_id, driver_version, compute_cap in rows:
        gpu = inventory.gpu(int(index))
        assert gpu.uuid == uuid
        assert gpu.product_name == name
        # nvidia-smi prints MiB rounded down; NVML gives bytes
        assert abs(gpu.memory_bytes // MIB - int(mem_mib)) <= 1, (gpu.memory_bytes, mem_mib)
        # nvidia-smi: 00000000:00:06.0 (8-digit domain, upper case); ours: 0000:00:06.0
        assert gpu.pci_bus_id == normalize_pci_bus_id(bus_id)
        assert inventory.driver_version == driver_version
        assert gpu.cuda_compute_capability == compute_cap
        compared.append(
            {
                "index": int(index),
                "uuid": [gpu.uuid, uuid],
                "name": [gpu.product_name, name],
                "memory (NVML bytes, smi MiB)": [gpu.memory_bytes, int(mem_mib)],
                "pciBusID": [gpu.pci_bus_id, bus_id],
                "driverVersion": [inventory.driver_version, driver_version],
                "computeCapability": [gpu.cuda_compute_capability, compute_cap],
            }
        )
    record.json("inventory-vs-nvidia-smi", "compare (NVML inventory, nvidia-smi)", compared, "all equal")


def test_resource_slice_of_this_host(inventory: Any, record: Recorder) -> None:
    slices = desired_slices(inventory, NODE, DRIVER, SliceFeatures(list_attributes=False))
    record.json(
        "resourceslice",
        f"controller.slices.desired_slices(inventory, {NODE!r}, {DRIVER!r}, "
        "SliceFeatures(list_attributes=False))",
        list(slices),
    )
    devices = [d for s in slices for d in s.get("devices", [])]
    assert [d["name"] for d in devices] == [f"gpu-{g.index}" for g in inventory.gpus]
    for d, g in zip(devices, inventory.gpus, strict=True):
        assert d["attributes"]["uuid"] == {"string": g.uuid}
        published = int(quantity_value(d["capacity"]["memory"]["value"]) or 0)
        assert g.memory_bytes - MIB < published <= g.memory_bytes
