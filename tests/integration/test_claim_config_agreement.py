"""One set of rules, checked twice: the chart's claim-config admission policy and the
plugin's config parser give the same verdict, with the same field path, on every input.

Hypothesis generates `opaque.parameters` of both API versions (ours,
`gpu.dra-driver.dev/v1alpha1`, and NVIDIA's, `resource.nvidia.com/v1beta1`): kinds,
strategies, every field and unknown ones, quantities from 0 to 2^63 and beyond in every
suffix (and strings that are almost quantities), wrong types and nulls, null or empty objects
where NVIDIA's driver takes its default; NVIDIA's kinds
with no counterpart here with their own fields (iommu, domainID). Each config goes
to the real API server twice, as server-side dry-run creates (nothing is stored): in a
ResourceClaim, and in a DeviceClass (whose config every claim of the class gets); and
through `parse_claim_config`, as the plugin reads it after a JSON round trip.
A disagreement fails the test with the config and the answers: admitted by one and
refused by another, or refused by two at different fields. An API-server validation
error (not the policy's) counts as a refusal without a field.

Two runs: a fixed seed, and a random one that is printed (and named in any failure), each
of at least 5,000 configs, sent in batches on several connections at once.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from dra_driver.sharing.config import ConfigError
from dra_driver.sharing.nvidia_config import parse_claim_config
from tests.harness.admission import PolicyBench, policy_bench
from tests.harness.cluster import ControlPlane
from tests.harness.driver_image import render_chart
from tests.harness.objects import RESOURCE_API, api_error, sync_request

DRIVER = "agree.dra-driver.dev"  # a release of its own: its policy is named after it
CLASS = "agree-any.example.com"  # a class the policy knows nothing of
DENIED = "denied request: "
FIXED_SEED = 38
PER_RUN = 5000
BATCH = 10  # configs per Hypothesis example, sent concurrently (a longer list overruns its data budget)
THREADS = 8
NV = "resource.nvidia.com/v1beta1"
_PATH = re.compile(r"[^ :]+")


# --------------------------------------------------------------------------- what is generated

_quantity_numbers = st.one_of(
    st.integers(0, 2**70).map(str),
    st.sampled_from(
        [
            "0",
            "1",
            "1.5",
            ".5",
            "5.",
            "0.0000000001",
            "1048576",
            "1048575",
            "1099511627776",
            "1099511627777",
            "9223372036854775807",
            "9223372036854775808",
            "18446744073709551616",
        ]
    ),
    st.decimals(0, 10**6, places=3, allow_nan=False, allow_infinity=False).map(str),
)
_suffixes = st.sampled_from(
    [
        "",
        "Ki",
        "Mi",
        "Gi",
        "Ti",
        "Pi",
        "Ei",
        "k",
        "M",
        "G",
        "T",
        "P",
        "E",
        "m",
        "u",
        "n",
        "e3",
        "E-2",
        "e9",
        "e+6",
        "i",
        "gi",
        "GB",
        "KI",
        " ",
    ]
)
quantity_texts = st.one_of(
    st.builds(
        lambda sign, n, s: f"{sign}{n}{s}",
        st.sampled_from(["", "", "", "+", "-"]),
        _quantity_numbers,
        _suffixes,
    ),
    st.sampled_from(
        [
            "1Mi",
            "1Ti",
            "1Ei",
            "1025Gi",
            "200Gi",
            "10Gi",
            "lots",
            "-64Mi",
            "1048576000m",
            " 1Gi",
            "1Gi ",
            "1e3Gi",
            "NaN",
            "",
            "10 GiB",
            "0x10",
            "1_000",
        ]
    ),
)
big_ints = st.one_of(
    st.integers(-5, 200),
    st.integers(0, 2**64 + 5),
    st.sampled_from([0, 1, 100, 101, 1000, 2**20 - 1, 2**20, 2**40, 2**40 + 1, 2**63 - 1, 2**63, 2**64]),
)
_text = st.text(alphabet="abzAZ09-_./ '\"\\é\n", max_size=6)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    big_ints,
    st.floats(allow_nan=False, allow_infinity=False),
    _text,
)
anything = st.one_of(scalars, st.lists(scalars, max_size=2), st.dictionaries(_text, scalars, max_size=2))
memory_values = st.one_of(quantity_texts, big_ints, anything)
unknown_keys = st.text(alphabet="abzAZ09-_. é", min_size=1, max_size=6)


@st.composite
def _one_in_ten(draw: Any, usual: Any, rare: Any) -> Any:
    return draw(rare) if draw(st.integers(0, 9)) == 9 else draw(usual)


def mostly(good: Any, bad: Any = None) -> Any:
    """`good` nine times in ten, else something of any type."""
    return _one_in_ten(good, bad if bad is not None else anything)


def or_empty(obj: Any) -> Any:
    """An object field: `obj` three times in four, else null or {} (what `kubectl create`
    leaves of a field whose only setting was removed)."""
    return st.one_of(obj, obj, obj, st.sampled_from([None, {}]))


def sometimes_without(obj: Any, key: str) -> Any:
    """`obj` (a strategy of objects) without `key` one time in four."""
    return st.tuples(obj, st.integers(0, 3)).map(
        lambda t: (
            {k: v for k, v in t[0].items() if k != key} if t[1] == 3 and isinstance(t[0], dict) else t[0]
        )
    )


def fields(required: dict[str, Any], optional: dict[str, Any], known: set[str]) -> Any:
    """An object with the optional fields present or not, and one time in ten unknown ones."""
    base = st.fixed_dictionaries(required, optional=optional)
    extra = st.dictionaries(unknown_keys.filter(lambda k: k not in known), anything, min_size=1, max_size=2)
    return _one_in_ten(base, st.builds(lambda a, b: {**a, **b}, base, extra))


def _mps_nvidia() -> Any:
    per_device = st.dictionaries(
        st.sampled_from(["0", "1", "12", "GPU-5b1c", "MIG-a-1", "first", "0\n", "GPU-", "-1", "GPU-x y"]),
        memory_values,
        max_size=2,
    )
    optional = {
        "defaultActiveThreadPercentage": mostly(
            st.one_of(st.integers(1, 100), st.integers(1, 100), big_ints)
        ),
        "defaultPinnedDeviceMemoryLimit": memory_values,
        "defaultPerDevicePinnedMemoryLimit": mostly(per_device),
        "multiUser": mostly(st.booleans()),
    }
    return fields({}, optional, set(optional))


def _sharing_nvidia() -> Any:
    time_slicing = fields(
        {}, {"interval": mostly(st.sampled_from(["Default", "Short", "Medium", "Long", None]))}, {"interval"}
    )
    required = {
        "strategy": mostly(st.sampled_from(["MPS"] * 5 + ["TimeSlicing"] * 3 + ["Fabric", "mps"])),
        "mpsConfig": mostly(or_empty(_mps_nvidia())),
    }
    optional = {"timeSlicingConfig": mostly(or_empty(time_slicing))}
    known = {*required, *optional}
    return sometimes_without(sometimes_without(fields(required, optional, known), "mpsConfig"), "strategy")


def _sharing_ours() -> Any:
    mps = {
        "defaultActiveThreadPercentage": mostly(
            st.one_of(st.integers(1, 100), st.integers(1, 100), big_ints)
        ),
        "defaultPinnedDeviceMemoryLimit": memory_values,
        "shmSize": memory_values,
    }
    required = {
        "strategy": mostly(st.sampled_from(["MPS"] * 5 + ["TimeSlicing"] * 3 + ["MPX"])),
        "mps": mostly(or_empty(fields({}, mps, set(mps)))),
    }
    known = {*required, "timeSlicing", "timeSlicingConfig"}
    plain = sometimes_without(sometimes_without(fields(required, {}, known), "mps"), "strategy")
    return st.one_of(
        plain, plain, plain, fields(required, {"timeSlicing": anything, "timeSlicingConfig": anything}, known)
    )


def _parameters(api_version: Any, kinds: Any, sharing: Any) -> Any:
    known = {"apiVersion", "kind", "sharing"}
    full = sometimes_without(
        fields({"apiVersion": api_version, "kind": kinds, "sharing": mostly(or_empty(sharing))}, {}, known),
        "sharing",
    )
    return st.tuples(full, st.integers(0, 19)).map(  # now and then no kind at all
        lambda t: {k: v for k, v in t[0].items() if k != "kind"} if t[1] == 19 else t[0]
    )


nvidia_parameters = _parameters(
    st.just(NV),
    mostly(
        st.sampled_from(
            ["GpuConfig"] * 6
            + ["MigDeviceConfig"] * 5
            + ["VfioDeviceConfig", "ComputeDomainChannelConfig", "ComputeDomainDaemonConfig", "GpuConfg"]
        )
    ),
    _sharing_nvidia(),
)
our_parameters = _parameters(
    mostly(
        st.sampled_from(
            [f"{DRIVER}/v1alpha1"] * 6
            + ["gpu.dra-driver.dev/v1alpha1"] * 3
            + [f"{DRIVER}/v1", "resource.nvidia.com/v1"]
        )
    ),
    mostly(st.sampled_from(["GpuConfig"] * 10 + ["GPUConfig", "MigDeviceConfig"])),
    _sharing_ours(),
)
# NVIDIA's kinds with no counterpart here, with their own fields (VfioDeviceConfig's iommu,
# the ComputeDomain configs' domainID and allocationMode) and now and then a stray one
_NVIDIA_ONLY_FIELDS = {
    "iommu": mostly(
        fields({}, {"backendPolicy": mostly(st.sampled_from(["LegacyOnly", "PreferIommuFD"])),
                    "enableAPIDevice": mostly(st.booleans())}, {"backendPolicy", "enableAPIDevice"})
    ),
    "domainID": mostly(st.uuids().map(str)),
    "allocationMode": mostly(st.sampled_from(["Single", "All"])),
}
nvidia_only_parameters = st.builds(
    lambda kind, rest: {"apiVersion": NV, "kind": kind, **rest},
    st.sampled_from(["VfioDeviceConfig", "ComputeDomainChannelConfig", "ComputeDomainDaemonConfig"]),
    fields({}, _NVIDIA_ONLY_FIELDS, set(_NVIDIA_ONLY_FIELDS) | {"apiVersion", "kind"}),
)
parameters = mostly(st.one_of(nvidia_parameters, nvidia_parameters, nvidia_only_parameters, our_parameters))


# --------------------------------------------------------------------------- both answers


@dataclass(frozen=True)
class Verdict:
    admitted: bool
    path: str | None  # the field the refusal names; None: admitted, or refused by API validation
    message: str

    def agrees_with(self, other: Verdict) -> bool:
        if self.admitted != other.admitted:
            return False
        return self.path is None or other.path is None or self.path == other.path


def plugin_verdict(params: Any) -> Verdict:
    try:
        parse_claim_config(json.loads(json.dumps(params)), DRIVER, "opaque.parameters")
    except ConfigError as e:
        match = _PATH.match(str(e))
        return Verdict(False, match.group(0) if match else "", str(e))
    return Verdict(True, None, "")


def claim(params: Any, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS}}],
                "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": params}}],
            }
        },
    }


def device_class(params: Any, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"config": [{"opaque": {"driver": DRIVER, "parameters": params}}]},
    }


def policy_verdict(api: client.ApiClient, namespace: str, params: Any, as_class: bool = False) -> Verdict:
    """The policy's answer to a claim with `params`, or to a DeviceClass with them (`as_class`)."""
    if as_class:
        path, body = f"{RESOURCE_API}/deviceclasses", device_class(params, f"agree-{namespace}")
    else:
        path, body = f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims", claim(params, "agree")
    try:
        sync_request(api, "POST", path, body, query={"dryRun": "All"})
    except ApiException as e:
        message = api_error(e)
        if DENIED in message:
            text = message.split(DENIED, 1)[1]
            match = _PATH.match(text)
            return Verdict(False, match.group(0) if match else "", text)
        if e.status in (400, 422):  # the API server's own validation: refused, no field of ours
            return Verdict(False, None, message)
        raise
    return Verdict(True, None, "")


# --------------------------------------------------------------------------- the bench


def _rendered_policy(tmp: Path) -> list[dict[str, Any]]:
    return render_chart(tmp, f"driverName={DRIVER}", show_only="templates/claim-config-policy.yaml")




@pytest.fixture(scope="module")
def bench(
    control_plane: ControlPlane, api: client.ApiClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PolicyBench]:
    probe = {"apiVersion": NV, "kind": "VfioDeviceConfig"}
    with policy_bench(control_plane, api, _rendered_policy(tmp_path_factory.mktemp("helm")), "agree",
                      lambda ns: not policy_verdict(api, ns, probe).admitted, THREADS) as bench:
        yield bench


def check_agreement(bench: PolicyBench, run_seed: int) -> tuple[int, float]:
    """Runs the property with `run_seed`; returns how many configs were checked and the seconds."""
    checked: list[int] = []
    pool = ThreadPoolExecutor(THREADS)

    def both(i_params: tuple[int, Any]) -> tuple[Any, Verdict, Verdict, Verdict]:
        i, params = i_params
        api = bench.clients[i % THREADS]
        return (
            params,
            policy_verdict(api, bench.namespace, params),
            policy_verdict(api, bench.namespace, params, as_class=True),
            plugin_verdict(params),
        )

    @settings(
        max_examples=PER_RUN // BATCH,
        database=None,
        deadline=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @seed(run_seed)
    @given(st.lists(parameters, min_size=BATCH, max_size=BATCH))
    def agree(batch: list[Any]) -> None:
        answers = list(pool.map(both, enumerate(batch)))
        checked.append(len(answers))
        wrong = [(p, a, c, b) for p, a, c, b in answers if not (a.agrees_with(b) and c.agrees_with(b))]
        assert not wrong, f"seed {run_seed}: {len(wrong)} of {len(batch)} disagree; first: " + "\n".join(
            f"config {json.dumps(p)}\n  policy (claim): {a}\n  policy (class): {c}\n  plugin: {b}"
            for p, a, c, b in wrong[:3]
        )

    start = time.monotonic()
    try:
        agree()
    finally:
        pool.shutdown()
    return sum(checked), time.monotonic() - start


# As NVIDIA's users write them (its demo's gpu-test-vfio-config.yaml; its ComputeDomain
# channel and daemon configs): both must refuse the kind, not one of its fields.
NVIDIA_ONLY = [
    {
        "apiVersion": NV,
        "kind": "VfioDeviceConfig",
        "iommu": {"backendPolicy": "LegacyOnly", "enableAPIDevice": True},
    },
    {"apiVersion": NV, "kind": "ComputeDomainChannelConfig", "domainID": "4f1b", "allocationMode": "All"},
    {"apiVersion": NV, "kind": "ComputeDomainDaemonConfig", "domainID": "4f1b"},
]


@pytest.mark.parametrize("params", NVIDIA_ONLY, ids=lambda p: str(p["kind"]))
def test_nvidias_kinds_with_no_counterpart_are_refused_for_their_kind_by_both(
    bench: PolicyBench, params: dict[str, Any]
) -> None:
    plugin = plugin_verdict(params)
    for as_class in (False, True):
        policy = policy_verdict(bench.clients[0], bench.namespace, params, as_class)
        assert policy.path == plugin.path == "opaque.parameters.kind", f"policy: {policy}\nplugin: {plugin}"
        assert policy.message == plugin.message and "offers no VFIO passthrough" in plugin.message


# Null objects where NVIDIA's driver takes its default (docs/migrating.md), refused by both
# before: both admit. (A null sharing, `timeSlicingConfig: {}` and a null mpsConfig with MPS
# were admitted by both already; the generated runs cover them.)
NV_GPU = {"apiVersion": NV, "kind": "GpuConfig"}
OURS = {"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig"}
NULL_OR_EMPTY = [
    {**NV_GPU, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": None}},
    {
        **NV_GPU,
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": None}, "mpsConfig": None},
    },
    {**NV_GPU, "sharing": {"strategy": "MPS", "mpsConfig": {}, "timeSlicingConfig": None}},
    {**OURS, "sharing": None},
    {**OURS, "sharing": {"strategy": "MPS", "mps": None}},
    {**OURS, "sharing": {"strategy": "TimeSlicing", "mps": None}},
]


@pytest.mark.parametrize("params", NULL_OR_EMPTY, ids=lambda p: json.dumps(p["sharing"]))
def test_a_null_or_empty_object_is_its_default_for_both(bench: PolicyBench, params: dict[str, Any]) -> None:
    plugin = plugin_verdict(params)
    for as_class in (False, True):
        policy = policy_verdict(bench.clients[0], bench.namespace, params, as_class)
        assert policy.admitted and plugin.admitted, f"policy: {policy}\nplugin: {plugin}"


@pytest.mark.parametrize("which", ["fixed", "random"])
def test_the_policy_and_the_plugin_give_the_same_verdict_on_every_config(
    bench: PolicyBench, which: str
) -> None:
    run_seed = FIXED_SEED if which == "fixed" else random.randrange(2**32)
    print(f"\n[agreement] seed {run_seed} ({which})")
    checked, seconds = check_agreement(bench, run_seed)
    print(f"[agreement] seed {run_seed}: {checked} configs agreed in {seconds:.1f} s")
    assert checked >= PER_RUN, f"seed {run_seed}: only {checked} configs were generated"
