"""The NVML readings beyond power (throttle reasons, memory, NVLink) and the node counters,
as PowerSampler samples them on its thread.

This machine has no GPU, so NVML cannot run: these tests hand the sampler a tiny fake
`pynvml` module with the few calls power.py makes, returning known values. What the fake
cannot show (that a real driver answers these calls) bench/nvml_probe.py checks on a GPU.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainvitals.hooks import node, power

NOT_SUPPORTED = 3  # NVML_ERROR_NOT_SUPPORTED


class FakeNvml(SimpleNamespace):
    """The pynvml calls power.py makes. NVLink counters grow 1000 KiB/s rx and 500 tx."""

    NVML_SUCCESS = 0
    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
    NVML_VALUE_TYPE_DOUBLE = 0
    NVML_VALUE_TYPE_UNSIGNED_INT = 1
    NVML_VALUE_TYPE_UNSIGNED_LONG = 2
    NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
    NVML_VALUE_TYPE_SIGNED_LONG_LONG = 4
    NVML_VALUE_TYPE_SIGNED_INT = 5
    NVMLError = RuntimeError

    def __init__(
        self, nvlink: bool = True, event_reasons: bool = True, clock=time.monotonic
    ) -> None:
        """`clock`: the time (seconds) the counters grow with; a test gives the sampler's."""
        super().__init__(asked_fields=[], nvlink=nvlink, clock=clock)
        if event_reasons:  # drivers >= 535; older ones only have the throttle-reasons name
            self.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x4 | 0x1

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return uuid

    def nvmlDeviceGetTotalEnergyConsumption(self, h) -> int:
        return int(self.clock() * 300_000)  # mJ: 300 W

    def nvmlDeviceGetClockInfo(self, h, clock: int) -> int:
        return 1980

    def nvmlDeviceGetTemperature(self, h, sensor: int) -> int:
        return 55

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h) -> int:
        return 0x40

    def nvmlDeviceGetMemoryInfo(self, h) -> SimpleNamespace:
        return SimpleNamespace(total=80 * 2**30, free=60 * 2**30, used=20 * 2**30)

    def nvmlDeviceGetFieldValues(self, h, fields: list) -> list:
        self.asked_fields.append(fields)
        kib = {self.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: 1000, 138: 500}
        return [
            SimpleNamespace(
                nvmlReturn=self.NVML_SUCCESS if self.nvlink else NOT_SUPPORTED,
                valueType=self.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
                value=SimpleNamespace(ullVal=int(self.clock() * kib[field])),
            )
            for field, _scope in fields
        ]


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device as far as power.py can tell: a fake pynvml and a device UUID."""

    def install(nvml: FakeNvml) -> torch.device:
        monkeypatch.setitem(sys.modules, "pynvml", nvml)
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda d: SimpleNamespace(uuid="fake")
        )
        return torch.device("cuda", 0)

    return install


def test_nvml_state_reads_every_field(fake_gpu) -> None:
    nvml = FakeNvml()
    source, why = power.open_source(fake_gpu(nvml), local_rank=0)
    assert source.name == "nvml" and why == ""
    state = source.state()
    assert (state.sm_clock_mhz, state.temperature_c) == (1980.0, 55.0)
    assert state.throttle_reasons == 0x5 and isinstance(state.throttle_reasons, int)
    assert state.memory_used_bytes == 20 * 2**30
    assert state.nvlink_rx_bytes > state.nvlink_tx_bytes > 0
    # Both NVLink counters, summed over every link: scopeId UINT_MAX, not link 0.
    assert nvml.asked_fields[-1] == [(139, 0xFFFFFFFF), (138, 0xFFFFFFFF)]


def test_older_driver_and_missing_nvlink_give_what_there_is(fake_gpu) -> None:
    source, _ = power.open_source(fake_gpu(FakeNvml(nvlink=False, event_reasons=False)), 0)
    state = source.state()
    assert state.throttle_reasons == 0x40  # through nvmlDeviceGetCurrentClocksThrottleReasons
    assert math.isnan(state.nvlink_rx_bytes) and math.isnan(state.nvlink_tx_bytes)
    assert state.memory_used_bytes == 20 * 2**30


def test_a_failing_call_costs_its_field_only(fake_gpu) -> None:
    nvml = FakeNvml()
    nvml.nvmlDeviceGetMemoryInfo = lambda h: (_ for _ in ()).throw(RuntimeError("NotSupported"))
    state = power.open_source(fake_gpu(nvml), 0)[0].state()
    assert math.isnan(state.memory_used_bytes) and state.sm_clock_mhz == 1980.0


class Clock:
    """The test's time (seconds): it moves only when the test says so."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_sampler_reports_nvlink_rates_and_device_state(fake_gpu) -> None:
    clock = Clock()  # the sampler's thread sleeps an hour: the test samples (tick)
    device = fake_gpu(FakeNvml(clock=clock))
    sampler = power.PowerSampler(device, local_rank=1, interval_s=3600, clock=clock)
    clock.now_s = 0.25
    sampler.tick()
    reading = sampler.read()
    sampler.close()
    assert sampler.source == "nvml"
    assert reading.nvlink_rx_bytes_per_s == pytest.approx(1000 * 1024)
    assert reading.nvlink_tx_bytes_per_s == pytest.approx(500 * 1024)
    assert reading.power_w == pytest.approx(300)
    assert reading.throttle_reasons == 0x5 and reading.memory_used_bytes == 20 * 2**30
    # Not the first local rank: the node's counters are someone else's to report.
    assert math.isnan(reading.net_rx_bytes_per_s) and math.isnan(reading.ib_tx_bytes_per_s)
    assert "local rank 0 only" in sampler.node_unavailable


def _net_dev(proc: Path, rx: int, tx: int) -> None:
    (proc / "net").mkdir(parents=True, exist_ok=True)
    (proc / "net" / "dev").write_text(
        f"Inter-| Receive | Transmit\n face |bytes packets|bytes packets\n  eth0: {rx} 1 {tx} 1\n"
    )


def _node_only_sampler(monkeypatch, tmp_path: Path, node_interval_s: float, clock: Clock):
    """A CPU sampler with no power source and a fake /proc/net/dev at zero bytes, on the
    test's clock (its thread sleeps an hour: the test samples, with tick)."""
    monkeypatch.setattr(power, "RAPL_ROOT", tmp_path / "no-rapl")
    monkeypatch.setattr(node, "PROC_ROOT", tmp_path)
    monkeypatch.setattr(node, "IB_ROOT", tmp_path / "no-ib")
    _net_dev(tmp_path, 0, 0)
    return power.PowerSampler(
        torch.device("cpu"),
        local_rank=0,
        interval_s=3600,
        node_interval_s=node_interval_s,
        clock=clock,
    )


def test_first_local_rank_samples_the_node(monkeypatch, tmp_path: Path) -> None:
    clock = Clock()
    sampler = _node_only_sampler(monkeypatch, tmp_path, node_interval_s=0.01, clock=clock)
    assert sampler.source == "" and sampler.node_unavailable.startswith("ib:")
    clock.now_s = 0.25
    sampler.tick()
    sampler.read()
    _net_dev(tmp_path, 10**6, 2 * 10**6)
    clock.now_s = 0.75
    sampler.tick()
    reading = sampler.read()
    sampler.close()
    # The bytes arrived between two node samples 0.5 s apart.
    assert reading.net_rx_bytes_per_s == pytest.approx(10**6 / 0.5)
    assert reading.net_tx_bytes_per_s == pytest.approx(2 * reading.net_rx_bytes_per_s)
    assert math.isnan(reading.ib_rx_bytes_per_s) and math.isnan(reading.power_w)
    assert math.isnan(reading.nvlink_rx_bytes_per_s) and math.isnan(reading.throttle_reasons)


def test_node_rates_hold_between_node_samples(monkeypatch, tmp_path: Path) -> None:
    """Node counters are read once per node interval; a read in between repeats the last
    rates rather than reporting none."""
    clock = Clock()
    sampler = _node_only_sampler(monkeypatch, tmp_path, node_interval_s=0.2, clock=clock)
    _net_dev(tmp_path, 10**6, 10**6)
    clock.now_s = 0.5
    sampler.tick()  # a node sample after the write
    first = sampler.read()
    clock.now_s = 0.625
    sampler.tick()  # within the same node interval: the device only
    second = sampler.read()
    sampler.close()
    assert first.net_rx_bytes_per_s == pytest.approx(10**6 / 0.5)
    assert second.net_rx_bytes_per_s == first.net_rx_bytes_per_s
