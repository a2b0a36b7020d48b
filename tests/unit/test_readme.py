"""README.md as a newcomer reads it: short enough to read, the commands as they must be typed
(`kubectl gpu` found on PATH, the namespace created before it is used, the plugin's flags after
its name) and the `kubectl gpu why` sample exactly what `why` prints on the demo's pending pod,
rebuilt here from the demo's nodes, classes and pod (no cluster)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from controller.slices import SliceFeatures, desired_slices
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.explain.render import render
from dra_driver.explain.why import PodClaim, explain_pod
from dra_driver.gpu import discover
from dra_driver.jsontypes import JSON
from tests.harness.examples import DEMO_NODES, MIG_NODE, MIG_TAINT, device_class_files, too_big_pod

README = Path(__file__).resolve().parents[2] / "README.md"
MAX_LINES = 250


def _text() -> str:
    return README.read_text()


def _blocks() -> list[list[str]]:
    return [b.strip("\n").splitlines() for b in re.findall(r"^```[a-z]*\n(.*?)^```", _text(), re.S | re.M)]


def test_the_readme_is_short() -> None:
    assert len(_text().splitlines()) <= MAX_LINES


def test_the_commands_are_typed_as_they_work() -> None:
    text = _text()
    assert ".venv/bin" in text and "PATH" in text  # where kubectl finds the gpu plugin
    commands = [line.removeprefix("$ ") for block in _blocks() for line in block]
    for i, line in enumerate(commands):
        applied = re.match(r"kubectl apply -n (\S+)", line)
        if applied:
            assert f"kubectl create namespace {applied[1]}" in commands[:i], line
    # kubectl takes no flags before a plugin's name ("flags cannot be placed before plugin name"),
    # which the README may say only as what kubectl refuses
    told = re.sub(r"kubectl refuses\s+`[^`]*`", "", text)
    assert not re.search(r"kubectl\s+(-\S+\s+\S+\s+)+gpu", told)
    assert "kubectl gpu why -n " in text


def _demo_slices() -> list[JSON]:
    boxes = [(n.name, n.profile, SliceFeatures(list_attributes=True)) for n in DEMO_NODES]
    boxes.append((MIG_NODE.name, MIG_NODE.profile, SliceFeatures(list_attributes=True, dynamic_mig=True)))
    slices = []
    for node, profile, features in boxes:
        specs = desired_slices(discover(profile), node, DRIVER, features)
        for n, spec in enumerate(specs):
            pool = {**spec["pool"], "generation": 1, "resourceSliceCount": len(specs)}
            slices.append({"metadata": {"name": f"{node}-{n}"}, "spec": {**spec, "pool": pool}})
    return slices


def test_the_why_sample_is_what_why_prints_on_the_demo() -> None:
    (sample,) = [b for b in _blocks() if b[0].startswith("pod gpu-demo/too-big-200gi")]
    template, pod = too_big_pod()
    pod["metadata"]["namespace"] = "gpu-demo"
    claim_name = re.search(r"\(gpu-demo/(too-big-200gi-gpu-\w+)\)", "\n".join(sample))
    assert claim_name, sample
    claim = {"metadata": {"namespace": "gpu-demo", "name": claim_name[1], "uid": "u"},
             "spec": template["spec"]["spec"]}
    nodes: list[JSON] = [{"metadata": {"name": n.name, "labels": {}}, "spec": {}} for n in DEMO_NODES]
    nodes.append({"metadata": {"name": MIG_NODE.name, "labels": {}}, "spec": {"taints": [MIG_TAINT]}})
    classes = {d["metadata"]["name"]: d for path in device_class_files()
               for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "DeviceClass"}
    report = explain_pod(pod, [PodClaim("gpu", claim)], nodes, _demo_slices(), classes, [])
    printed = render(report).splitlines()
    assert printed[-1].startswith("(-v")  # the hint the sample leaves out
    assert sample == printed[:-1]
