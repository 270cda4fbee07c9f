"""Device power, energy, clocks and temperature, sampled on a background thread.

Sources, tried in order:
- NVML (`nvidia-ml-py`) on CUDA devices: power (mW), cumulative energy (mJ since the driver
  loaded), SM clock (MHz), temperature (C). Converted to W, J, MHz, C where they enter.
- RAPL under /sys/class/powercap on CPUs that expose it: the package energy counter (uJ),
  which wraps at max_energy_range_uj. A package is shared by every rank on it, so only the
  first local rank reports it; the others report nothing rather than count it twice.
Where no source works, `unavailable` says which were tried and why each failed; power is
never invented. Reading NVML is a host call: it never waits for the device.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

RAPL_ROOT = Path("/sys/class/powercap")


@dataclass(frozen=True)
class PowerReading:
    power_w: float = math.nan  # mean since the previous read
    energy_j: float = math.nan  # since the sampler started
    sm_clock_mhz: float = math.nan
    temperature_c: float = math.nan


class _Nvml:
    name = "nvml"

    def __init__(self, device: torch.device) -> None:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        self._nvml = pynvml
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        try:  # the UUID names the right GPU whatever CUDA_VISIBLE_DEVICES renumbered
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except pynvml.NVMLError:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)

    def energy_j(self) -> float:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3  # mJ -> J

    def extras(self) -> tuple[float, float]:
        n = self._nvml
        clock = float(n.nvmlDeviceGetClockInfo(self._handle, n.NVML_CLOCK_SM))
        temp = float(n.nvmlDeviceGetTemperature(self._handle, n.NVML_TEMPERATURE_GPU))
        return clock, temp


class _Rapl:
    name = "rapl"

    def __init__(self, zone: Path) -> None:
        self._counter = zone / "energy_uj"
        self._range_uj = int((zone / "max_energy_range_uj").read_text())
        self._last_uj = int(self._counter.read_text())  # raises if unreadable (permissions)
        self._total_uj = 0

    def energy_j(self) -> float:
        now = int(self._counter.read_text())
        self._total_uj += (now - self._last_uj) % self._range_uj  # the counter wraps
        self._last_uj = now
        return self._total_uj / 1e6  # uJ -> J

    def extras(self) -> tuple[float, float]:
        return math.nan, math.nan


def open_source(device: torch.device, local_rank: int) -> tuple[object | None, str]:
    """(a working source, or None and the reasons each candidate failed)."""
    reasons = []
    if device.type == "cuda":
        try:
            return _Nvml(device), ""
        except Exception as e:  # ImportError, NVMLError: any means "not this source"
            reasons.append(f"nvml: {e}")
    else:
        reasons.append("nvml: not a CUDA device")
    zone = RAPL_ROOT / "intel-rapl:0"
    if local_rank != 0:
        reasons.append("rapl: reported by local rank 0 only (one package counter per host)")
    elif not zone.exists():
        reasons.append(f"rapl: {zone} not present")
    else:
        try:
            return _Rapl(zone), ""
        except (OSError, ValueError) as e:
            reasons.append(f"rapl: {e}")
    return None, "; ".join(reasons)


class PowerSampler:
    """Samples a source every `interval_s` on a daemon thread; `read()` never blocks on it."""

    def __init__(
        self, device: torch.device, local_rank: int = 0, interval_s: float | None = 0.1
    ) -> None:
        if interval_s is None:
            self._source, self.unavailable = None, "power sampling is off (power_interval_s=0)"
        else:
            self._source, self.unavailable = open_source(device, local_rank)
        self.source = self._source.name if self._source else ""
        self.interval_s = interval_s or 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._start_j = self._energy_now()
        self._latest = PowerReading()
        self._last_read = (time.monotonic(), 0.0)  # (time, energy since start)
        self._thread = None
        if self._source is not None:
            self._thread = threading.Thread(target=self._run, name="trainvitals-power", daemon=True)
            self._thread.start()

    def _energy_now(self) -> float:
        return self._source.energy_j() if self._source else math.nan

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                energy_j = self._energy_now() - self._start_j
                clock, temp = self._source.extras()
            except Exception:
                continue  # a failed sample is skipped; the next one may succeed
            with self._lock:
                self._latest = PowerReading(math.nan, energy_j, clock, temp)

    def read(self) -> PowerReading:
        """Latest sample, with power averaged since the previous read (energy difference)."""
        with self._lock:
            latest = self._latest
        now = time.monotonic()
        last_t, last_j = self._last_read
        power = math.nan
        if math.isfinite(latest.energy_j) and now > last_t:
            power = (latest.energy_j - last_j) / (now - last_t)
            self._last_read = (now, latest.energy_j)
        return PowerReading(power, latest.energy_j, latest.sm_clock_mhz, latest.temperature_c)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
