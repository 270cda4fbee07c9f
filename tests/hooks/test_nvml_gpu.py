"""power.py's NVML readings from a real driver. Skipped without a GPU."""

from __future__ import annotations

import math
import time

import pytest
import torch

from trainvitals.hooks import power

pytestmark = pytest.mark.gpu


def test_nvml_reads_device_state_and_rates() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    # Node counters every 0.1 s (1 s by default), so that the read below has their rates.
    sampler = power.PowerSampler(device, local_rank=0, interval_s=0.05, node_interval_s=0.1)
    assert sampler.source == "nvml", sampler.unavailable
    x = torch.randn(4096, 4096, device=device)
    for _ in range(50):
        x = x @ x.T / 4096
    torch.cuda.synchronize()
    time.sleep(0.3)
    reading = sampler.read()
    sampler.close()
    assert reading.sm_clock_mhz > 0 and reading.power_w > 0
    assert isinstance(reading.throttle_reasons, int) and reading.throttle_reasons >= 0
    _free_b, total_b = torch.cuda.mem_get_info(device)
    assert 0 < reading.memory_used_bytes <= total_b
    # No NVLink on a single-GPU machine may read NaN (not supported) or 0 bytes/s.
    for rate in (reading.nvlink_rx_bytes_per_s, reading.nvlink_tx_bytes_per_s):
        assert math.isnan(rate) or rate >= 0
    assert reading.net_rx_bytes_per_s >= 0 and math.isfinite(reading.net_tx_bytes_per_s)
