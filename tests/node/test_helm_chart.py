"""The Helm chart on its own: `helm lint --strict` is clean, the default render is what the
node test installs, and bad values are refused with a message that names the value and what
to write. Needs only the helm binary (hack/helm/build.sh), no cluster."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
import yaml

from controller.attributes import LINKED_SET_ATTRIBUTES
from controller.claim_shapes import linked_class
from tests.harness.driver_image import CHART, build_helm
from tests.harness.helm import Helm


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Helm]:
    yield Helm(build_helm(), None, tmp_path_factory.mktemp("helm-home"))


def _render(helm: Helm, *sets: str) -> list[dict]:  # type: ignore[type-arg]
    args = [a for s in sets for a in ("--set", s)]
    out = helm.run("template", "gpu-dra-driver", str(CHART), "-n", "gpu-dra-driver", *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_lint_is_clean(helm: Helm) -> None:
    proc = helm.run("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def test_default_render(helm: Helm) -> None:
    docs = _render(helm)
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
    assert set(kinds) >= set(  # other templates (the claim-config policy) add their own
        [
            "ServiceAccount/gpu-dra-driver",
            "ClusterRole/gpu-dra-driver",
            "ClusterRoleBinding/gpu-dra-driver",
            "DaemonSet/gpu-dra-driver",
            "DeviceClass/gpu.dra-driver.dev",
            "DeviceClass/mig.gpu.dra-driver.dev",
            *(
                f"{kind}/gpu-dra-driver-{what}"
                for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
                for what in ("resourceslices", "events", "claim-status")
            ),
        ]
    )
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "gpu-dra-driver:0.1.0"
    assert "--no-memory-shares" in container["args"] and "--health-monitor" in container["args"]
    assert "--no-dynamic-mig" in container["args"]
    assert "--health-taint-effect=NoSchedule" in container["args"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}


def test_the_linked_class_and_its_policy_are_the_ones_dra_driver_claim_relies_on(helm: Helm) -> None:
    """deviceClasses.linked: the selector-free class claim_shapes.linked_class(driver), and the
    policy whose constraint list is attributes.LINKED_SET_ATTRIBUTES (what only whole GPUs not
    in MIG mode carry); neither without the value."""
    for driver in ("gpu.dra-driver.dev", "gpu.example.com"):
        docs = _render(helm, f"driverName={driver}")
        linked = [d for d in docs if d["kind"] == "DeviceClass" and "linked" in d["metadata"]["name"]]
        assert [(d["metadata"]["name"], d["spec"]) for d in linked] == [(linked_class(driver), {})]
        (policy,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"
                     and d["metadata"]["name"] == f"linked-claims.{driver}"]
        (linking,) = [v["expression"] for v in policy["spec"]["variables"] if v["name"] == "linking"]
        listed = set(re.findall(r'"([^"]+)"', linking.split(" in [", 1)[1].split("]", 1)[0]))
        assert listed == {f"{driver}/{name}" for name in LINKED_SET_ATTRIBUTES}
    off = _render(helm, "deviceClasses.linked=false")
    assert not [d for d in off if "linked" in d["metadata"]["name"]]


def test_an_image_digest_pins_the_pods_to_that_image(helm: Helm) -> None:
    """image.digest set: the DaemonSet runs repository@digest and the tag is not used."""
    digest = "sha256:" + "0123456789abcdef" * 4

    def image(*sets: str) -> str:
        (ds,) = [d for d in _render(helm, *sets) if d["kind"] == "DaemonSet"]
        return str(ds["spec"]["template"]["spec"]["containers"][0]["image"])

    repo = "registry.example.com/gpu-dra-driver"
    sets = (f"image.repository={repo}", "image.tag=9.9.9")
    assert image(*sets, f"image.digest={digest}") == f"{repo}@{digest}"
    assert image(*sets) == f"{repo}:9.9.9"


def test_feature_switches_reach_the_plugin(helm: Helm) -> None:
    docs = _render(
        helm,
        "memoryShares.enabled=true",
        "memoryShares.only=true",
        "dynamicMig.enabled=true",
        "health.enabled=false",
        "extendedResource.enabled=true",
        "simulate=hgx-h200",
        "driverName=gpu.example.com",
    )
    names = {f"{d['kind']}/{d['metadata']['name']}" for d in docs}
    assert {
        "DeviceClass/gpu-share.gpu.example.com",
        "DeviceClass/extended.gpu.example.com",
        "DeviceClass/mig-dynamic.gpu.example.com",
    } <= names
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    wanted = {"--memory-shares", "--memory-shares-only", "--dynamic-mig", "--no-health-monitor"}
    wanted.add("--simulate=hgx-h200")
    wanted.add("--driver-name=gpu.example.com")
    assert wanted <= set(args)
    assert not any(a.startswith("--driver-root") for a in args), "a simulated node mounts no driver root"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("health.taintEffect=Evict", "value must be one of 'NoSchedule', 'NoExecute'"),
        ("metrics.port=70000", "/metrics/port"),
        ("listAttributes=maybe", "/listAttributes"),
        ("memoryshares.enabled=true", "additional properties 'memoryshares' not allowed"),
        ("kubeletPlugin.nodeSelector.gpu=true", "got boolean, want string"),
        ("driverName=gpu.nvidia.com", "gpu.nvidia.com is the name of NVIDIA's DRA driver"),
        ("driverName=GPU", "is not a DNS subdomain"),
        ("cdiDir=var/run/cdi", 'cdiDir: "var/run/cdi" must be an absolute path'),
        ("image.digest=sha256:abc", "'/image/digest': 'sha256:abc' does not match pattern"),
        ("image.digest=" + "a" * 64, "/image/digest"),  # the algorithm is part of it
        ("image.digest=sha256:" + "A" * 64, "/image/digest"),  # digests are lowercase hex
    ],
)
def test_bad_values_are_refused_clearly(helm: Helm, value: str, message: str) -> None:
    proc = helm.run("template", "x", str(CHART), "--set", value, check=False)
    assert proc.returncode != 0, f"{value} was accepted"
    assert message in proc.stderr, proc.stderr


def test_every_host_path_a_release_writes_carries_its_driver_name(helm: Helm) -> None:
    """Two releases with different driver names never share a state dir or an MPS root (the
    plugin sockets and CDI spec names carry the driver name in the plugin itself)."""
    paths = {}
    for driver in ("gpu.a.example.com", "gpu.b.example.com"):
        (ds,) = [d for d in _render(helm, f"driverName={driver}") if d["kind"] == "DaemonSet"]
        args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
        volumes = ds["spec"]["template"]["spec"]["volumes"]
        host = {v["name"]: v["hostPath"]["path"] for v in volumes if "hostPath" in v}
        assert f"--state-dir=/run/{driver}/state" in args and f"--mps-root=/run/{driver}/mps" in args
        assert (host["state"], host["mps"]) == (f"/run/{driver}/state", f"/run/{driver}/mps")
        paths[driver] = {host["state"], host["mps"]}
    assert not paths["gpu.a.example.com"] & paths["gpu.b.example.com"]
    (ds,) = [d for d in _render(helm, "stateDir=/srv/state") if d["kind"] == "DaemonSet"]
    assert "--state-dir=/srv/state" in ds["spec"]["template"]["spec"]["containers"][0]["args"]


def test_plugin_accepts_every_flag_the_chart_passes(helm: Helm) -> None:
    """Each `--flag` the DaemonSet passes exists in `dra-driver kubelet-plugin --help`."""
    usage = subprocess.run(
        [sys.executable, "-m", "dra_driver", "kubelet-plugin", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for sets in ((), ("health.enabled=false", "memoryShares.enabled=true", "memoryShares.only=true",
                      "simulate=l4x4")):
        (ds,) = [d for d in _render(helm, *sets) if d["kind"] == "DaemonSet"]
        args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
        plugin_args = args[args.index("kubelet-plugin") + 1 :]
        for arg in plugin_args:
            flag = arg.split("=", 1)[0]
            assert flag in usage, f"the chart passes {flag}, which `dra-driver kubelet-plugin` does not know"


def test_the_plain_manifests_are_the_chart_rendered(helm: Helm) -> None:
    """deploy/base (kubectl apply -f) is the chart with its default values, whole: RBAC,
    policies, the DaemonSet's securityContext, volumes and ports. deploy/base/render.sh
    writes it; this renders again and compares every object."""
    args = (
        "template",
        "gpu-dra-driver",
        str(CHART),
        "-n",
        "gpu-dra-driver",
        "--set",
        "namespace.create=true",
    )
    rendered = [d for d in yaml.safe_load_all(helm.run(*args).stdout) if d]
    base = [
        d
        for path in sorted((CHART.parents[1] / "base").glob("*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if d
    ]

    def key(d: dict) -> str:  # type: ignore[type-arg]
        return f"{d['kind']}/{d['metadata']['name']}"

    wanted = {key(d): d for d in rendered if d["kind"] != "DeviceClass"}
    have = {key(d): d for d in base}
    assert sorted(have) == sorted(wanted), "run deploy/base/render.sh"
    for name, doc in wanted.items():
        assert have[name] == doc, f"deploy/base differs from the chart in {name}: run deploy/base/render.sh"


def test_the_plugin_pod_mounts_and_exposes_only_what_it_uses(helm: Helm) -> None:
    """Of the kubelet's directories only plugins/<driver> and plugins_registry; the driver
    root read-only down to its submounts; a read-only root filesystem; the metrics port
    bound to the pod's IP; no NetworkPolicy unless asked for."""
    docs = _render(helm, "driverName=gpu.example.com")
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    hosts = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    kubelet = {p for p in hosts if p.startswith("/var/lib/kubelet")}
    assert kubelet == {"/var/lib/kubelet/plugins/gpu.example.com", "/var/lib/kubelet/plugins_registry"}
    (root,) = [m for m in container["volumeMounts"] if m["name"] == "driver-root"]
    assert root["readOnly"] and root["recursiveReadOnly"] == "IfPossible" and "mountPropagation" not in root
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "--metrics-bind-address=$(POD_IP)" in container["args"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    # benchmarks.prepare._charted_env runs the plugin with the same (its RSS figures are as charted)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MALLOC_ARENA_MAX"] == "2"
    assert pod.get("automountServiceAccountToken", True) is True
    assert not [d for d in docs if d["kind"] == "NetworkPolicy"]


def test_the_network_policy_admits_only_the_named_sources(helm: Helm) -> None:
    prometheus = (
        '{"namespaceSelector":{"matchLabels":{"team":"mon"}},"podSelector":{"matchLabels":{"app":"prom"}}}'
    )
    args = ["template", "x", str(CHART), "--set", "metrics.networkPolicy.enabled=true"]
    named = helm.run(
        *args,
        "--set-json",
        f"metrics.networkPolicy.prometheus={prometheus}",
        "--set",
        "metrics.networkPolicy.fromCIDRs={10.1.0.0/16}",
    ).stdout
    (policy,) = [d for d in yaml.safe_load_all(named) if d and d["kind"] == "NetworkPolicy"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert rule["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"team": "mon"}},
            "podSelector": {"matchLabels": {"app": "prom"}},
        },
        {"ipBlock": {"cidr": "10.1.0.0/16"}},
    ]
    nobody = helm.run(*args).stdout
    (policy,) = [d for d in yaml.safe_load_all(nobody) if d and d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["ingress"] == [], "no source named must admit nothing, not everything"
