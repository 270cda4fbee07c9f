"""Device power, energy, clocks, temperature and interconnect, sampled on a background thread.

Sources, tried in order:
- NVML (`nvidia-ml-py`) on CUDA devices: power (mW), cumulative energy (mJ since the driver
  loaded), SM clock (MHz), temperature (C), clocks-event ("throttle") reasons (a bitmask),
  device memory in use (bytes, every process on the GPU) and the NVLink data payload this
  GPU sent and received (cumulative KiB, all links summed). Converted to W, J, MHz, C and
  bytes where they enter.
- RAPL under /sys/class/powercap on CPUs that expose it: the package energy counter (uJ),
  which wraps at max_energy_range_uj. A package is shared by every rank on it, so only the
  first local rank reports it; the others report nothing rather than count it twice.
The node's network counters (node.py: IP interfaces, InfiniBand ports) are sampled on the
same thread, by the first local rank only for the same reason.
Where no source works, `unavailable` (and `node_unavailable`) says which were tried and why
each failed; nothing is invented. Reading NVML is a host call: it never waits for the device.
`read()` only reads what the thread last sampled.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .node import NodeCounters, NodeRates, NodeTotals
from .records import SAMPLED_FIELDS

RAPL_ROOT = Path("/sys/class/powercap")
# nvmlFieldValue_t.scopeId that sums an NVLink counter over every link (nvml.h).
NVML_ALL_LINKS = 0xFFFFFFFF
KIB = 1024
# Node counters are cumulative byte counts read from files: rates need no finer sampling,
# and reading them ten times a second cost the thread 6.7 ms of CPU per second (0.66 ms
# at once a second) on the CPU reference machine.
NODE_INTERVAL_S = 1.0


@dataclass(frozen=True)
class PowerReading:
    power_w: float = math.nan  # mean since the previous read
    energy_j: float = math.nan  # since the sampler started
    sm_clock_mhz: float = math.nan
    temperature_c: float = math.nan
    # NVML clocks-event reasons, an int bitmask (nvmlClocksEventReason*: 0x1 idle,
    # 0x4 software power cap, 0x8 hardware slowdown, 0x20/0x40 thermal...); NaN: unknown.
    throttle_reasons: int | float = math.nan
    memory_used_bytes: float = math.nan  # of the whole device, every process
    # Means since the previous read. NVLink: this GPU's; net and ib: the node's, reported
    # by the first local rank only (NaN on the others).
    nvlink_rx_bytes_per_s: float = math.nan
    nvlink_tx_bytes_per_s: float = math.nan
    net_rx_bytes_per_s: float = math.nan
    net_tx_bytes_per_s: float = math.nan
    ib_rx_bytes_per_s: float = math.nan
    ib_tx_bytes_per_s: float = math.nan


@dataclass(frozen=True)
class _DeviceState:
    sm_clock_mhz: float = math.nan
    temperature_c: float = math.nan
    throttle_reasons: int | float = math.nan
    memory_used_bytes: float = math.nan
    nvlink_rx_bytes: float = math.nan  # cumulative, as the driver counts it
    nvlink_tx_bytes: float = math.nan


@dataclass(frozen=True)
class _Sample:
    time_s: float  # monotonic
    energy_j: float = math.nan  # since the sampler started
    device: _DeviceState = field(default_factory=_DeviceState)
    node: NodeTotals | None = None


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

    def state(self) -> _DeviceState:
        """Everything else NVML reads; a query the device does not support gives NaN."""
        n, h = self._nvml, self._handle
        # Newer drivers name them clocks-event reasons; the throttle-reasons call is the old name.
        reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
        reasons = reasons or n.nvmlDeviceGetCurrentClocksThrottleReasons
        rx_bytes, tx_bytes = _or_nan(self._nvlink_bytes, 2)
        return _DeviceState(
            sm_clock_mhz=_or_nan(lambda: float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))),
            temperature_c=_or_nan(
                lambda: float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))
            ),
            throttle_reasons=_or_nan(lambda: int(reasons(h))),
            memory_used_bytes=_or_nan(lambda: float(n.nvmlDeviceGetMemoryInfo(h).used)),
            nvlink_rx_bytes=rx_bytes,
            nvlink_tx_bytes=tx_bytes,
        )

    def _nvlink_bytes(self) -> tuple[float, float]:
        """(received, sent) NVLink data payload since the driver loaded, all links summed.

        NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_* are cumulative KiB counters despite the name;
        pynvml sets scopeId only from a (field, scope) pair, and a bare field reads link 0.
        """
        n = self._nvml
        fields = [
            (n.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, NVML_ALL_LINKS),
            (n.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_ALL_LINKS),
        ]
        rx, tx = n.nvmlDeviceGetFieldValues(self._handle, fields)
        return _field_value(n, rx) * KIB, _field_value(n, tx) * KIB


def _field_value(nvml, value) -> float:
    """A nvmlFieldValue_t as a float, NaN when its own return code is not success."""
    if value.nvmlReturn != nvml.NVML_SUCCESS:
        return math.nan
    member = {
        nvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        nvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    }.get(value.valueType, "usVal")
    return float(getattr(value.value, member))


def _or_nan(read: Callable, n: int = 1):
    """read(), or NaN (n of them) when the device or driver does not support it."""
    try:
        return read()
    except Exception:  # NVMLError_NotSupported and kin: absent, not fatal
        return math.nan if n == 1 else (math.nan,) * n


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

    def state(self) -> _DeviceState:
        return _DeviceState()


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


def _rate(now: float, before: float, dt_s: float) -> float:
    """Mean rate of a cumulative counter; NaN without two samples or across a counter reset."""
    if dt_s <= 0 or now < before:
        return math.nan
    return (now - before) / dt_s


class PowerSampler:
    """Samples the device every `interval_s` and the node's counters every `node_interval_s`
    on a daemon thread; `read()` never blocks on it. `clock` stamps the samples (seconds;
    tests inject one and call `tick` themselves)."""

    def __init__(
        self,
        device: torch.device,
        local_rank: int = 0,
        interval_s: float | None = 0.1,
        node_interval_s: float = NODE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._node: NodeCounters | None = None
        if interval_s is None:
            self._source, self.unavailable = None, "power sampling is off (power_interval_s=0)"
            self.node_unavailable = "node counters are off (power_interval_s=0)"
        else:
            self._source, self.unavailable = open_source(device, local_rank)
            self._node, self.node_unavailable = _open_node(local_rank, clock)
        self.source = self._source.name if self._source else ""
        self.interval_s = interval_s or 0.0
        self.node_interval_s = node_interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._start_j = self._energy_now()
        # The baseline of the first rates; energy stays unknown until the thread samples it.
        node = self._node.totals() if self._node else None
        first = self._sample(node)
        self._latest = replace(first, energy_j=math.nan)
        # Power is energy over the time between two samples: a read that finds no new
        # sample gives the last figure again (dividing by the time between reads would
        # give 0 then, and the next read several samples' energy at once).
        self._power_from = first  # the sample the next power figure starts from
        self._power_w = math.nan
        self._last_sample = self._latest  # the sample the previous read's rates ended at
        self._node_rates = NodeRates()  # the last node rates read() gave
        self._node_due_s = self._clock() + self.node_interval_s
        self._thread = None
        if self._source is not None or self._node is not None:
            self._thread = threading.Thread(target=self._run, name="trainvitals-power", daemon=True)
            self._thread.start()

    def _energy_now(self) -> float:
        return self._source.energy_j() if self._source else math.nan

    def _sample(self, node: NodeTotals | None) -> _Sample:
        energy_j = self._energy_now() - self._start_j
        state = self._source.state() if self._source else _DeviceState()
        return _Sample(self._clock(), energy_j, state, node)

    def _run(self) -> None:
        # Without a device source only the node is sampled, at its own pace.
        wake_s = self.interval_s if self._source else max(self.interval_s, self.node_interval_s)
        while not self._stop.wait(wake_s):
            self.tick()

    def tick(self) -> None:
        """Take one sample (the thread's work, every `interval_s`); the node's counters
        only once `node_interval_s` has passed since they were last read."""
        try:
            node = self._latest.node  # only the sampling thread replaces _latest
            if self._node is not None and self._clock() >= self._node_due_s:
                node = self._node.totals()
                self._node_due_s = self._clock() + self.node_interval_s
            sample = self._sample(node)
        except Exception:
            return  # a failed sample is skipped; the next one may succeed
        with self._lock:
            self._latest = sample

    def read(self) -> PowerReading:
        """Latest sample, with power and byte rates averaged between the samples since the
        previous read (or, if none came since, those of the previous read)."""
        with self._lock:
            latest = self._latest
        start = self._power_from
        if math.isfinite(latest.energy_j) and latest.time_s > start.time_s:
            self._power_w = (latest.energy_j - start.energy_j) / (latest.time_s - start.time_s)
            self._power_from = latest
        power = self._power_w
        before, self._last_sample = self._last_sample, latest
        dt_s = latest.time_s - before.time_s
        dev, dev_before = latest.device, before.device
        if latest.node is not before.node and before.node is not None:
            self._node_rates = latest.node.rates_since(before.node)
        node = self._node_rates  # no new node sample since the last read: its rates again
        return PowerReading(
            power_w=power,
            energy_j=latest.energy_j,
            sm_clock_mhz=dev.sm_clock_mhz,
            temperature_c=dev.temperature_c,
            throttle_reasons=dev.throttle_reasons,
            memory_used_bytes=dev.memory_used_bytes,
            nvlink_rx_bytes_per_s=_rate(dev.nvlink_rx_bytes, dev_before.nvlink_rx_bytes, dt_s),
            nvlink_tx_bytes_per_s=_rate(dev.nvlink_tx_bytes, dev_before.nvlink_tx_bytes, dt_s),
            net_rx_bytes_per_s=node.net_rx_bytes_per_s,
            net_tx_bytes_per_s=node.net_tx_bytes_per_s,
            ib_rx_bytes_per_s=node.ib_rx_bytes_per_s,
            ib_tx_bytes_per_s=node.ib_tx_bytes_per_s,
        )

    def start_step(self, logged: bool) -> None:
        pass

    def end_step(self, loss: torch.Tensor) -> None:
        pass

    def collect(self, step: int, steps: int) -> dict[str, float]:
        """The meter protocol: read(), as the rank slot's sampled fields (host numbers)."""
        reading = self.read()
        return {k: getattr(reading, k, math.nan) for k in SAMPLED_FIELDS}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)


def _open_node(local_rank: int, clock: Callable[[], float]) -> tuple[NodeCounters | None, str]:
    """The node's network counters, on the first local rank only (one node, counted once)."""
    if local_rank != 0:
        return None, "net, ib: reported by local rank 0 only (one node, counted once)"
    counters = NodeCounters(clock=clock)
    return (counters if counters.available else None), counters.unavailable
