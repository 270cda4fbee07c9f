"""Power sources: honest about what is missing; RAPL arithmetic on a recorded sysfs layout.

This machine has neither a GPU nor /sys/class/powercap, so the RAPL test reads a copy of
the powercap files laid out in a temporary folder (the only stand-in in these tests).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from trainvitals.hooks import power


def test_no_source_says_what_was_tried(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(power, "RAPL_ROOT", tmp_path / "absent")
    sampler = power.PowerSampler(torch.device("cpu"))
    assert sampler.source == ""
    assert "nvml: not a CUDA device" in sampler.unavailable
    assert "rapl:" in sampler.unavailable and "not present" in sampler.unavailable
    reading = sampler.read()
    assert math.isnan(reading.power_w) and math.isnan(reading.energy_j)
    sampler.close()


def test_off_is_reported_as_off() -> None:
    sampler = power.PowerSampler(torch.device("cpu"), interval_s=None)
    assert sampler.source == "" and "off" in sampler.unavailable


def _zone(root: Path, energy_uj: int, range_uj: int) -> Path:
    zone = root / "intel-rapl:0"
    zone.mkdir(parents=True, exist_ok=True)
    (zone / "energy_uj").write_text(str(energy_uj))
    (zone / "max_energy_range_uj").write_text(str(range_uj))
    return zone


def test_rapl_counts_energy_across_a_counter_wrap(tmp_path: Path) -> None:
    zone = _zone(tmp_path, energy_uj=999_000_000, range_uj=1_000_000_000)
    rapl = power._Rapl(zone)
    (zone / "energy_uj").write_text("500000")  # wrapped: 1 J to the top, then 0.5 J
    assert rapl.energy_j() == 1.5


def test_rapl_sampler_reports_power(monkeypatch, tmp_path: Path) -> None:
    zone = _zone(tmp_path, energy_uj=0, range_uj=10**12)
    monkeypatch.setattr(power, "RAPL_ROOT", tmp_path)
    sampler = power.PowerSampler(torch.device("cpu"), interval_s=0.01)
    assert sampler.source == "rapl"
    (zone / "energy_uj").write_text(str(20_000_000))  # 20 J
    sampler.tick()  # what its thread does every interval_s
    reading = sampler.read()
    sampler.close()
    assert reading.energy_j == 20.0 and reading.power_w > 0
    second = power.PowerSampler(torch.device("cpu"), local_rank=1)
    assert second.source == "" and "local rank 0 only" in second.unavailable


def test_power_holds_when_steps_are_logged_faster_than_power_is_sampled(
    monkeypatch, tmp_path: Path
) -> None:
    """A package drawing a steady 300 W, sampled every 100 ms and read every 40 ms (a
    logged step shorter than the sampling period): every reading is 300 W. Dividing by the
    time between reads gave 0 W on reads that found no new sample, and about 2.5x on the
    next one. The clock is the test's: it samples (tick) when 100 ms have passed."""
    zone = _zone(tmp_path, energy_uj=0, range_uj=10**15)
    monkeypatch.setattr(power, "RAPL_ROOT", tmp_path)
    now_s = [0.0]
    sampler = power.PowerSampler(torch.device("cpu"), interval_s=3600, clock=lambda: now_s[0])
    readings, due_s = [], 0.1
    for i in range(1, 41):
        now_s[0] = i * 0.04
        (zone / "energy_uj").write_text(str(round(300.0 * now_s[0] * 1e6)))
        if now_s[0] >= due_s:
            sampler.tick()
            due_s += 0.1
        readings.append(sampler.read().power_w)
    sampler.close()
    assert all(math.isnan(w) for w in readings[:2]), readings  # until the first sample
    assert readings[2:] == pytest.approx([300.0] * 38, rel=1e-6), readings
