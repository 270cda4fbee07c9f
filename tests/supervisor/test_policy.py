"""The policy file: defaults, what it accepts, and each bad input refused naming what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainvitals.supervisor.policy import Policy, PolicyError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return path


def test_the_default_observes_every_kind() -> None:
    policy = Policy.load(None)
    assert policy.for_kind("sdc").mode == "observe"
    assert policy.for_kind("rank_lost").mode == "observe"
    assert policy.limits.max_restarts_per_hour == 3


def test_a_policy_acts_per_kind_with_limits(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "[limits]\nmax_restarts_per_hour = 2\ncooldown_s = 10\n"
        '[kinds.sdc]\nmode = "act"\n[kinds.loss_diverging]\nmode = "act"\nskip_data = true\n',
    )
    policy = Policy.load(path)
    assert policy.for_kind("sdc").mode == "act"
    assert policy.for_kind("sdc_replica").mode == "observe"  # not named: observed
    assert policy.for_kind("loss_diverging").skip_data
    assert (policy.limits.max_restarts_per_hour, policy.limits.cooldown_s) == (2, 10.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[kinds.sdc\nmode = "act"', "not valid TOML"),
        ('[kinds.sdc_typo]\nmode = "act"', "unknown alert kind 'sdc_typo'"),
        ('[kinds.sdc]\nmode = "fix"', "kinds.sdc.mode must be one of"),
        ('[kinds.sdc]\nmood = "act"', "kinds.sdc.mood: unknown setting"),
        ('[kinds.straggler]\nmode = "act"', "not automated"),
        ("[kinds.sdc]\nskip_data = true", "only loss_diverging takes it"),
        ("[limits]\nmax_fenced_fraction = 1.0", "fencing every node ends the job"),
        ('[limits]\ncooldown_s = "soon"', "limits.cooldown_s must be float"),
        ("[limits]\nmax_restarts_per_hour = true", "must be int"),
        ("[alerting]\nx = 1", r"unknown sections \['alerting'\]"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_problem(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(PolicyError, match=message) as e:
        Policy.load(write(tmp_path, text))
    assert "policy.toml" in str(e.value)  # names the file


def test_a_missing_policy_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read it"):
        Policy.load(tmp_path / "nope.toml")


def test_an_unknown_alert_kind_is_refused() -> None:
    with pytest.raises(PolicyError, match="unknown alert kind 'gpu_on_fire'"):
        Policy.load(None).for_kind("gpu_on_fire")
