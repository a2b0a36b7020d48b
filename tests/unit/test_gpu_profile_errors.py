"""A malformed profile gives one ProfileError that names the file and the field, and nothing else."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.gpu import ProfileError, discover, profile_names
from dra_driver.gpu.sim.profiles import _shipped, load_profile


def base() -> dict[str, Any]:
    data = yaml.safe_load((_shipped() / "a100-mig.yaml").read_text())
    assert isinstance(data, dict)
    return data


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def edit(mutate: Any) -> dict[str, Any]:
    data = copy.deepcopy(base())
    mutate(data)
    return data


CASES = [
    ("missing uuid", lambda d: d["gpus"][1].pop("uuid"), "gpus[1].uuid", "required field is missing"),
    (
        "wrong type",
        lambda d: d["gpu_defaults"].update(memory_bytes="lots"),
        "gpu_defaults.memory_bytes",
        "integer",
    ),
    ("override wins", lambda d: d["gpus"][3].update(memory_bytes=-1), "gpus[3].memory_bytes", "integer >= 1"),
    (
        "bad enum",
        lambda d: d["gpu_defaults"].update(brand="NVIDIAA"),
        "gpu_defaults.brand",
        "unknown value 'NVIDIAA'",
    ),
    ("typo", lambda d: d["gpus"][0].update(memroy_bytes=1), "gpus[0].memroy_bytes", "unknown field"),
    ("top typo", lambda d: d.update(nvlink_pair=[]), "nvlink_pair", "unknown field"),
    (
        "cc as float",
        lambda d: d["gpu_defaults"].update(cuda_compute_capability=8.0),
        "gpu_defaults.cuda_compute_capability",
        "quoted",
    ),
    ("bad uuid", lambda d: d["gpus"][2].update(uuid="GPU-1234"), "gpus[2].uuid", "GPU-xxxxxxxx"),
    (
        "dup uuid",
        lambda d: d["gpus"][2].update(uuid=d["gpus"][0]["uuid"]),
        "gpus[2].uuid",
        "same value as gpus[0]",
    ),
    (
        "dup bus",
        lambda d: d["gpus"][3].update(pci_bus_id="0000:07:00.0"),
        "gpus[3].pci_bus_id",
        "same value as gpus[0]",
    ),
    ("pair to nowhere", lambda d: d.update(nvlink_pairs=[[0, 9, 2]]), "nvlink_pairs[0]", "GPU indexes < 8"),
    (
        "switch links length",
        lambda d: d["gpu_defaults"].update(nvswitch_links=[2, 2]),
        "gpu_defaults.nvswitch_links",
        "expected 6 integers",
    ),
    (
        "too many links",
        lambda d: d["gpu_defaults"].update(nvlink_max_links=6),
        "gpu_defaults.nvlink_max_links",
        "uses 12 links",
    ),
    (
        "mig overlap",
        lambda d: d["gpus"][6]["mig"]["devices"][1].update(placement=0),
        "gpus[6].mig.devices[1].placement",
        "already used",
    ),
    (
        "mig bad placement",
        lambda d: d["gpus"][5]["mig"]["devices"][1].update(placement=2),
        "gpus[5].mig.devices[1].placement",
        "can start only at slices [0, 4]",
    ),
    (
        "mig unknown profile",
        lambda d: d["gpus"][4]["mig"]["devices"][0].update(profile="7g.80gb"),
        "gpus[4].mig.devices[0].profile",
        "no such MIG profile",
    ),
    (
        "mig while disabled",
        lambda d: d["gpus"][4]["mig"].update(enabled=False),
        "gpus[4].mig.devices",
        "not enabled",
    ),
    (
        "error on unknown call",
        lambda d: d["gpus"][0].update(errors={"nvmlDeviceGetFoo": "NOT_SUPPORTED"}),
        "gpus[0].errors.nvmlDeviceGetFoo",
        "not an NVML call",
    ),
    (
        "unknown error code",
        lambda d: d.update(errors={"nvmlInit": "NOPE"}),
        "errors.nvmlInit",
        "unknown value 'NOPE'",
    ),
    ("no gpus", lambda d: d.update(gpus=[]), "gpus", "at least one GPU"),
    ("driver missing", lambda d: d.pop("driver"), "driver", "required field is missing"),
    (
        "bad fabric uuid",
        lambda d: d["gpus"][0].update(fabric={"state": "COMPLETED", "cluster_uuid": "x"}),
        "gpus[0].fabric.cluster_uuid",
        "not a UUID",
    ),
]


@pytest.mark.parametrize(("label", "mutate", "field", "problem"), CASES, ids=[c[0] for c in CASES])
def test_malformed_profile_names_file_and_field(
    tmp_path: Path, label: str, mutate: Any, field: str, problem: str
) -> None:
    path = write(tmp_path, edit(mutate))
    with pytest.raises(ProfileError) as caught:
        discover(str(path))
    err = caught.value
    assert (err.path, err.field) == (str(path), field)
    assert problem in err.problem
    assert str(err).startswith(f"invalid GPU profile {path}: {field}: ")


def test_the_unmodified_base_is_valid(tmp_path: Path) -> None:
    """Guards the cases above: each fails only because of its own edit."""
    assert len(discover(str(write(tmp_path, base()))).gpus) == 8


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "driver: {version: '1', cuda_version: 12080}\ngpus:\n  - uuid: [unclosed\n")
    with pytest.raises(ProfileError, match=r"node\.yaml: line \d+, column \d+: not valid YAML"):
        load_profile(str(path))


def test_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="expected a mapping, got list"):
        load_profile(str(write(tmp_path, "- 1\n- 2\n")))


def test_missing_file_and_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read the file"):
        load_profile(str(tmp_path / "nope.yaml"))
    with pytest.raises(ProfileError, match=r"no such profile; shipped profiles: .*hgx-h200") as caught:
        load_profile("hgx-h300")
    assert caught.value.path == "hgx-h300"


def test_every_shipped_profile_is_valid() -> None:
    for name in profile_names():
        assert load_profile(name).name == name
