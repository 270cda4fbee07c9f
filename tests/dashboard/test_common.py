"""Shared display helpers: formats, empty-state messages, alert rows."""

from __future__ import annotations

import math

import pandas as pd

from trainvitals.dashboard.client import RunSummary
from trainvitals.dashboard.common import alerts_view, duration_label, fmt, no_power_message


def test_fmt_and_duration_never_print_nan() -> None:
    assert fmt(math.nan, ".1f") == "n/a"
    assert fmt(None, ".1f", missing="-") == "-"
    assert fmt(0.25, ".1f", unit=" %") == "0.2 %"
    assert duration_label(math.nan) == "n/a"
    assert duration_label(40) == "40 s"
    assert duration_label(3 * 3600 + 5 * 60) == "3 h 5 min"
    assert duration_label(2 * 86_400 + 4 * 3600 + 59) == "2 d 4 h"


def test_no_power_message_names_the_sources_tried_when_the_run_said() -> None:
    tried = "nvml: no NVIDIA driver; rapl: no /sys/class/powercap"
    assert tried in no_power_message(RunSummary("r", power_source="", power_unavailable=tried))
    assert "nvml" in no_power_message(RunSummary("r", power_source="nvml"))
    assert "did not say" in no_power_message(RunSummary("r"))


def test_alerts_view_names_layers_and_puts_the_newest_first() -> None:
    alerts = pd.DataFrame(
        {"time_unix_s": [1.0, 2.0], "step": [3, 9], "layer": [1, None], "message": ["a", "b"]}
    ).astype({"layer": "Int64"})
    view = alerts_view(alerts, ["emb", "layers.0"])
    assert view["message"].tolist() == ["b", "a"]
    assert view["layer"].isna().tolist() == [True, False]
    assert view["layer"].iloc[1] == "layers.0"
    assert view["layer_index"].iloc[1] == 1  # what a jump needs
    assert view.columns[0] == "time"


def test_si_scales_to_a_prefix_and_keeps_a_word_unit_apart() -> None:
    from trainvitals.dashboard.common import si

    assert si(1.902e8, "FLOP/s") == "190.2 MFLOP/s"
    assert si(0.5, "W") == "500 mW"
    assert si(5156.0, "tokens/s") == "5.156 k tokens/s"
    assert si(200.0, "W") == "200 W"
    assert si(float("nan"), "J") == "n/a"
    assert si(0.0, "B/s") == "0 B/s"
