"""Settings from files, environment variables and flags: parsed by type, errors name the field."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from trainvitals.analyzer.settings_io import (
    build,
    merged,
    read_env,
    read_file,
    read_overrides,
)


@dataclass(frozen=True)
class _Settings:
    window: int = 10
    ratio: float = 0.5
    enabled: bool = True
    floor_s: float | None = None

    def __post_init__(self) -> None:
        if self.window < 3:
            raise ValueError("demo.window must be >= 3")


def test_text_values_are_parsed_to_the_field_types() -> None:
    got = build(_Settings, "demo", {"window": "20", "ratio": "0.25", "enabled": "off"}, "--set")
    assert got == _Settings(window=20, ratio=0.25, enabled=False)
    assert build(_Settings, "demo", {"floor_s": "2.5"}, "--set").floor_s == 2.5


@pytest.mark.parametrize(
    "values, message",
    [
        ({"window": "ten"}, "--set: demo.window must be an integer, got 'ten'"),
        ({"window": 2.5}, "demo.window must be an integer, got 2.5"),
        ({"ratio": "nan"}, "demo.ratio must be a number"),
        ({"enabled": "maybe"}, "demo.enabled must be true or false"),
        ({"windw": 3}, "demo.windw is not a setting (known in [demo]: enabled, floor_s"),
        ({"window": 2}, "--set: demo.window must be >= 3"),  # the class's own check
    ],
)
def test_bad_values_name_the_field_and_the_source(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        build(_Settings, "demo", values, "--set")


def test_env_and_flags_are_read_by_section_and_field() -> None:
    env = {"TRAINVITALS_ANALYZER__DEMO__WINDOW": "12", "PATH": "/bin"}
    assert read_env(env) == {"demo": {"window": "12"}}
    assert read_overrides(["demo.window=14", " demo.ratio = 0.1"]) == {
        "demo": {"window": "14", "ratio": "0.1"}
    }
    with pytest.raises(ValueError, match="TRAINVITALS_ANALYZER__DEMO: expected"):
        read_env({"TRAINVITALS_ANALYZER__DEMO": "1"})
    with pytest.raises(ValueError, match=r"expected SECTION\.FIELD=VALUE"):
        read_overrides(["window=3"])


def test_later_sources_override_earlier_ones_field_by_field() -> None:
    got = merged({"demo": {"window": 5, "ratio": 0.2}}, {"demo": {"window": "7"}})
    assert got == {"demo": {"window": "7", "ratio": 0.2}}


def test_files_toml_and_json_and_their_errors(tmp_path) -> None:
    toml = tmp_path / "a.toml"
    toml.write_text("[demo]\nwindow = 20\n")
    assert read_file(toml) == {"demo": {"window": 20}}
    js = tmp_path / "a.json"
    js.write_text('{"demo": {"ratio": 0.3}}')
    assert read_file(js) == {"demo": {"ratio": 0.3}}
    js.write_text('{"demo": 3}')
    with pytest.raises(ValueError, match="expected sections of settings"):
        read_file(js)
    toml.write_text("[demo\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        read_file(toml)
    with pytest.raises(ValueError, match="cannot read it"):
        read_file(tmp_path / "missing.toml")
