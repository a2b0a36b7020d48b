"""docs/observability.md's table of NVIDIA's metric names: every metric that NVIDIA's
gpu-kubelet-plugin v0.5.0 defines has a row, and every name of ours the table gives as its
counterpart is one this driver serves, so a dashboard carried over by the table finds its series.

NVIDIA's names are read from `sigs.k8s.io/dra-driver-nvidia-gpu@v0.5.0`,
`pkg/metrics/dra_requests.go` (`Namespace: "nvidia_dra"` and each `Name`; counters end in
`_total` there already), the only metrics the plugin registers besides component-base's
legacy registry's own (process, Go runtime, registered/disabled/hidden_metrics_total) and the
scrape handler's `promhttp_metric_handler_*`."""

from __future__ import annotations

import re
from pathlib import Path

from dra_driver import metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
NVIDIA = {
    "nvidia_dra_requests_total",
    "nvidia_dra_request_duration_seconds",
    "nvidia_dra_requests_inflight",
    "nvidia_dra_prepared_devices",
    "nvidia_dra_node_prepare_errors_total",
    "nvidia_dra_node_unprepare_errors_total",
}


def _rows() -> list[list[str]]:
    text = DOC.read_text()
    section = text.split("### NVIDIA's metric names", 1)[1].split("\n### ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines[1:]]


def test_every_nvidia_plugin_metric_has_a_row() -> None:
    named = {n for row in _rows() for n in re.findall(r"`(nvidia_dra_\w+)`", row[0])}
    assert named == NVIDIA


def test_every_counterpart_named_is_served_here() -> None:
    served = set()
    for family in metrics.REGISTRY.collect():  # a counter's family name has no _total
        served |= {family.name, f"{family.name}_total"} if family.type == "counter" else {family.name}
    ours = set()
    for row in _rows():
        here = row[2] + row[3] + (row[0] if row[2] == "the same names" else "")
        ours |= set(re.findall(r"\b((?:gpu_dra|process|python)_\w+)", here))
    ours.discard("process_network_")  # Go's, named as what is not here
    assert ours, "the table names no metric of ours"
    assert ours <= served, f"named in {DOC.name} but not served: {sorted(ours - served)}"
