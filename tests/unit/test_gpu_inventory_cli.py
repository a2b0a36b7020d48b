"""`dra-driver inventory`: the table, the documented JSON, the profile list, and the no-driver message."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pynvml
import pytest
from click.testing import CliRunner

from dra_driver import log
from dra_driver.commands.inventory import inventory
from dra_driver.gpu import profile_names

DOC = Path(__file__).resolve().parents[2] / "docs" / "inventory.md"
REQUIRED_GPU_KEYS = {"index", "uuid", "productName", "memory", "nvlinkPeers", "nvlinkGroups"}


@pytest.fixture(autouse=True)
def logs_to_stderr() -> None:
    # As `dra-driver` main does; structlog's unconfigured default would print to stdout.
    log.configure("warning", "json")


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(inventory, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_json_has_the_documented_keys() -> None:
    code, out, _ = invoke("--simulate", "dgx1-v100", "-o", "json")
    assert code == 0
    doc = json.loads(out)
    assert {
        "schemaVersion",
        "source",
        "driverVersion",
        "cudaDriverVersion",
        "gpus",
        "nvlink",
        "connectivity",
    } <= set(doc)
    assert (doc["driverVersion"], doc["cudaDriverVersion"], doc["source"]) == (
        "535.230.02",
        "12.2",
        "simulated:dgx1-v100",
    )
    gpu0 = doc["gpus"][0]
    assert set(gpu0) >= REQUIRED_GPU_KEYS
    assert gpu0["nvlinkPeers"] == [1, 2, 3, 4]
    assert gpu0["nvlinkGroups"] == {"2": "nvl2-0-1", "4": "nvl4-0-1-2-3"}
    assert gpu0["memory"] == 34089205760 and isinstance(gpu0["memory"], int)
    assert doc["connectivity"][0] == ["X", "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS"]


def test_every_emitted_key_is_documented() -> None:
    documented = {part for key in re.findall(r"`([A-Za-z.]+)`", DOC.read_text()) for part in key.split(".")}
    for name in ("a100-mig", "gb200-nvl-node"):
        doc = json.loads(invoke("--simulate", name, "-o", "json")[1])
        keys = set(doc) | set(doc["nvlink"]) | {k for g in doc["gpus"] for k in g}
        keys |= {k for g in doc["gpus"] for m in g["migDevices"] for k in m}
        keys |= {k for g in doc["gpus"] if g["fabricClique"] for k in g["fabricClique"]}
        assert keys - documented == set(), f"undocumented keys in {name}"


def test_mig_json() -> None:
    doc = json.loads(invoke("--simulate", "a100-mig", "-o", "json")[1])
    migs = doc["gpus"][6]["migDevices"]
    assert [m["profile"] for m in migs] == ["2g.10gb", "1g.5gb", "1g.5gb", "3g.20gb"]
    assert migs[1]["placement"] == {"start": 2, "size": 1} and migs[1]["memory"] == 4864 * 2**20


def test_table_is_readable() -> None:
    code, out, _ = invoke("--simulate", "a100-pcie-bridged")
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("GPU  PRODUCT"))
    # The table shows the clique layers the slices publish (docs/nvlink.md), not the legacy groups.
    for column in ("PRODUCT", "MEMORY", "PCI", "NUMA", "NVLINK PEERS", "CLIQUE LAYERS"):
        assert column in header
    assert any(
        re.match(r"0\s+NVIDIA A100 80GB PCIe\s+80\.0 GiB\s+8\.0\s+0000:17:00\.0\s+0\s+off\s+1\s+"
                 r"nvlinkClique0=0-1$", x)
        for x in lines
    )
    assert "  {0,1}   2     nvlinkClique0 (layer 0), nvlinkDomain" in lines
    matrix = lines[lines.index("Connectivity:") + 1 :]
    assert re.split(r"\s+", matrix[1].strip()) == ["GPU0", "X", "NV12", "SYS", "SYS"]


def test_list_profiles() -> None:
    code, out, _ = invoke("--list-profiles")
    assert code == 0
    listed = [line.split()[0] for line in out.splitlines()]
    assert listed == list(profile_names())
    assert len(listed) >= 8
    code, out, _ = invoke("--list-profiles", "-o", "json")
    assert {p["name"]: p["gpus"] for p in json.loads(out)}["dgx1-v100"] == 8


def test_no_driver_message(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    result = CliRunner().invoke(inventory, [])
    assert result.exit_code == 1
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "No NVIDIA driver found" in result.stderr
    assert "--simulate hgx-h200" in result.stderr and "--list-profiles" in result.stderr
    assert "Traceback" not in result.output
    assert result.stdout == ""


def test_bad_profile_is_one_message(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("driver: {version: '1', cuda_version: 12080}\ngpus: [{uuid: nope}]\n")
    result = CliRunner().invoke(inventory, ["--simulate", str(path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert f"invalid GPU profile {path}: gpus[0].uuid" in result.stderr
    assert result.stdout == ""
