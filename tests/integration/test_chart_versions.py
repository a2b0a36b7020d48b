"""`helm install` of the chart against the session's control plane, whatever its Kubernetes version
(issue 41; `make test-versions` runs 1.34 to 1.37). Every object the chart makes must be accepted
by that API server (policies in the CEL it allows, fields it knows); with no GPU node the
DaemonSet simply has no pod. A feature that needs a gate the version leaves off is refused by
the chart with a message that names the gate, unless kubernetesFeatureGates says it is on.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.harness.cluster import ControlPlane, gate_mode
from tests.harness.driver_image import CHART, build_helm
from tests.harness.helm import Helm

GATES = "{DRAPartitionableDevices,DRAConsumableCapacity,DRAExtendedResource,DRADeviceTaints}"


@pytest.fixture(scope="module")
def helm(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Helm]:
    yield Helm(build_helm(), Path(control_plane.kubeconfig), tmp_path_factory.mktemp("helm-home"))


def _install(helm: Helm, *sets: str, check: bool = True) -> tuple[str, str]:
    release = f"v{uuid.uuid4().hex[:6]}"
    args = ["install", release, str(CHART), "-n", release, "--create-namespace",
            "--set", f"driverName={release}.example.com"]
    for s in sets:
        args += ["--set", s]
    proc = helm.run(*args, check=check)
    return release, proc.stderr + proc.stdout


def _uninstall(helm: Helm, release: str) -> None:
    helm.run("uninstall", release, "-n", release, check=False)


def test_the_chart_installs_with_its_defaults(helm: Helm) -> None:
    release, _ = _install(helm)
    _uninstall(helm, release)


def test_gated_features_install_where_the_gates_are_on_and_are_refused_clearly_where_not(
    control_plane: ControlPlane, helm: Helm
) -> None:
    features = ("memoryShares.enabled=true", "consumableShares=memory", "dynamicMig.enabled=true",
                "extendedResource.enabled=true")
    minor = control_plane.version[1]
    if minor >= 36:
        release, _ = _install(helm, *features)
        _uninstall(helm, release)
        return
    # 1.34's and 1.35's schedulers give a GPU out whole and as a share: there only the share
    # views (the chart refuses memoryShares without `only` there before it looks at the gates)
    shares = ("memoryShares.only=true",) if minor <= 35 else ()
    release, out = _install(helm, *features, *shares, check=False)
    assert "needs the" in out and "DRAConsumableCapacity" in out and f"1.{minor}" in out, out
    assert "kubernetesFeatureGates" in out, out
    if gate_mode() == "all":  # the gates are on here: the operator says so and the chart installs
        release, _ = _install(helm, *features, *shares, f"kubernetesFeatureGates={GATES}")
        _uninstall(helm, release)


GATES_34_35 = "kubernetesFeatureGates={DRAPartitionableDevices,DRAConsumableCapacity}"


def test_a_change_of_kubernetes_feature_gates_rolls_the_plugin_pods(helm: Helm) -> None:
    """The plugin learns the server's features at start: an upgrade naming other gates must
    change the DaemonSet's pod template, or nothing restarts (issue 54)."""
    def pod_annotations(*sets: str) -> dict[str, str]:
        args = [a for s in sets for a in ("--set", s)]
        out = helm.run("template", "r", str(CHART), "--show-only", "templates/daemonset.yaml", *args).stdout
        (daemonset,) = [d for d in yaml.safe_load_all(out) if d]
        return dict(daemonset["spec"]["template"]["metadata"]["annotations"])

    before = pod_annotations()
    after = pod_annotations("kubernetesFeatureGates={DRAPartitionableDevices}")
    assert before["checksum/feature-gates"] != after["checksum/feature-gates"]
    assert before == pod_annotations("kubernetesFeatureGates=null")


@pytest.mark.parametrize("version", ["v1.34.4", "v1.35.4", "v1.36.3"])
def test_memory_shares_beside_whole_gpus_are_refused_before_1_36_whatever_its_gates(
    helm: Helm, version: str
) -> None:
    """1.34's and (measured on a real v1.35.4, make test-versions) 1.35's schedulers give a GPU
    out whole and as a memory share: there the chart asks for memoryShares.only."""
    def template(*sets: str) -> subprocess.CompletedProcess[str]:
        args = [a for s in ("memoryShares.enabled=true", GATES_34_35, *sets) for a in ("--set", s)]
        return helm.run("template", "r", str(CHART), "--kube-version", version, *args, check=False)

    done = template()
    if version in ("v1.34.4", "v1.35.4"):
        assert done.returncode != 0 and "memoryShares.only=true" in done.stderr, done.stderr
        assert "1.36 or later" in done.stderr, done.stderr
        only = template("memoryShares.only=true")
        assert only.returncode == 0, only.stderr
    else:
        assert done.returncode == 0, done.stderr
