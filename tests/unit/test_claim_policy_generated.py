"""The chart's claim-config policy is what the rules table generates, and the table is what the
node's parsers run: one row, both checkers."""

from __future__ import annotations

import pytest

from dra_driver.sharing import config, nvidia_config, policy_cel, rules
from dra_driver.sharing.config import ConfigError


def test_the_charts_policy_is_the_generated_one() -> None:
    assert policy_cel.CHART_FILE.read_text() == policy_cel.render(), (
        "deploy/helm/gpu-dra-driver/templates/claim-config-policy.yaml differs from what "
        "dra_driver/sharing/rules.py generates: run `make policy` (and deploy/base/render.sh)"
    )


def test_every_marker_of_the_skeleton_is_filled() -> None:
    assert "<<" not in policy_cel.render()


def test_every_reason_of_the_table_is_in_the_policy() -> None:
    text = policy_cel.render()
    for reason in rules.reasons():
        assert reason in text, reason


def test_a_new_row_is_checked_by_the_parser_and_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row added to the table is an allowed field with its check on both sides."""
    mps = {"apiVersion": "gpu.dra-driver.dev/v1alpha1", "kind": "GpuConfig"}
    ok = {**mps, "sharing": {"strategy": "MPS", "mps": {"maxClients": 5}}}
    with pytest.raises(ConfigError, match=r"unknown field 'maxClients'"):
        config.parse_gpu_config(ok)
    row = rules.Field(rules.OURS, "sharing.mps", "maxClients", rules.Check.PERCENTAGE, "must be 1 to 100")
    monkeypatch.setattr(rules, "FIELDS", (*rules.FIELDS, row))
    assert '"opaque.parameters.sharing.mps.maxClients: must be 1 to 100"' in policy_cel.render()
    config.parse_gpu_config(ok)
    with pytest.raises(ConfigError, match=r"mps.maxClients: must be 1 to 100"):
        config.parse_gpu_config({**mps, "sharing": {"strategy": "MPS", "mps": {"maxClients": 500}}})


@pytest.mark.parametrize("field", [f for f in rules.FIELDS if f.check is not rules.Check.STRUCTURE],
                         ids=lambda f: f"{f.form}:{f.parent}.{f.name}")
def test_the_parser_runs_each_row(field: rules.Field) -> None:
    """A value no row accepts is refused with the row's reason, at the row's path."""
    form = "gpu.dra-driver.dev/v1alpha1" if field.form == rules.OURS else nvidia_config.API_VERSION
    params: dict[str, object] = {"apiVersion": form, "kind": "GpuConfig"}
    leaf = field.parent.split(".")[-1]
    strategy = "TimeSlicing" if leaf == "timeSlicingConfig" else "MPS"
    params["sharing"] = {"strategy": strategy, leaf: {field.name: []}}
    with pytest.raises(ConfigError) as refused:
        nvidia_config.parse_claim_config(params)
    assert f"{field.parent}.{field.name}" in str(refused.value)
    assert field.reason in str(refused.value)


def test_every_rule_of_the_table_is_a_validation_of_a_defined_variable() -> None:
    """Each rule is a validation of the policy (or both) its row names, over a variable that
    policy defines."""
    text = policy_cel.render()
    claim, classes = text.split("\nkind: ValidatingAdmissionPolicy\n")[1:3]
    for policy, where in ((claim, (rules.Policy.CLAIM, rules.Policy.BOTH)),
                          (classes, (rules.Policy.CLASSES, rules.Policy.BOTH))):
        variables, validations = policy.split("  validations:\n", 1)
        validations = validations.split("\n---\n", 1)[0]
        mine = [r for r in rules.RULES if r.policy in where]
        for rule in mine:
            assert f"    - name: {rule.variable}\n" in variables, rule.variable
            assert f"variables.{rule.variable}" in validations, rule.variable
        assert validations.count("- expression:") == len(mine)
