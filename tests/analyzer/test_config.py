"""One analyzer configuration: defaults, a file, env vars and flags, in that order."""

from __future__ import annotations

import pytest

from trainvitals.analyzer.config import AnalyzerConfig


def test_defaults_are_the_detectors_own() -> None:
    from trainvitals.analyzer.straggler import StragglerSettings

    assert AnalyzerConfig.load().straggler == StragglerSettings()


def test_the_printed_file_reads_back_to_the_same_configuration(tmp_path) -> None:
    config = AnalyzerConfig.load()
    path = tmp_path / "analyzer.toml"
    path.write_text(config.to_toml())
    assert AnalyzerConfig.load(path) == config


def test_file_then_environment_then_flags(tmp_path) -> None:
    path = tmp_path / "analyzer.toml"
    field, default = _an_int_setting()
    path.write_text(f"[stall]\n{field} = {default + 1}\n")
    env = {f"TRAINVITALS_ANALYZER__STALL__{field.upper()}": str(default + 2)}
    assert getattr(AnalyzerConfig.load(path).stall, field) == default + 1
    assert getattr(AnalyzerConfig.load(path, environ=env).stall, field) == default + 2
    got = AnalyzerConfig.load(path, [f"stall.{field}={default + 3}"], env)
    assert getattr(got.stall, field) == default + 3
    assert got.straggler == AnalyzerConfig().straggler  # other sections keep their defaults


def _an_int_setting() -> tuple[str, int]:
    """A whole-number field of the stall settings, with its default."""
    stall = AnalyzerConfig().stall
    for name, value in vars(stall).items():
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    raise AssertionError("the stall settings have no whole-number field")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["stragler.window=3"], "--set: no detector section 'stragler'"),
        (["straggler.nope=3"], "straggler.nope is not a setting"),
        (["canary.window=3"], r"canary.window is not a setting \(\[canary\] has none\)"),
        (["liveness.silence_s=-1"], "liveness.silence_s"),
        (["layer_attribution.together_fraction=0"], "layer_attribution.together_fraction"),
    ],
)
def test_mistakes_are_named(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AnalyzerConfig.load(overrides=overrides)


def test_layer_attribution_settings_reach_the_spike_detectors_layer_history() -> None:
    from trainvitals.analyzer.detectors import LossSpikeDetector
    from trainvitals.analyzer.engine import default_detectors
    from trainvitals.analyzer.offline import step_detectors

    config = AnalyzerConfig.load(overrides=["layer_attribution.lookback=7"])
    for detectors in (default_detectors(config), step_detectors(config)):
        (spike,) = [d for d in detectors if isinstance(d, LossSpikeDetector)]
        assert spike.layers.settings == config.layer_attribution
        assert spike.layers.settings.lookback == 7
