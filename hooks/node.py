"""Network traffic of the node: IP interfaces (/proc/net/dev) and InfiniBand ports (sysfs).

Both sources are cumulative counters of the whole node. `NodeCounters.totals()` sums them
(bytes since the counters were opened, wraps and resets accounted for) and `read()` turns
them into rates, bytes/s since the previous read. Every rank of a node sees the same
counters, so only the first local rank should report them (power.PowerSampler does that),
or the node would be counted once per GPU.

- /proc/net/dev: receive and transmit bytes of every interface except loopback, parsed by
  the names in its header line. Kernel-bypass traffic (RDMA, GPUDirect) does not pass
  through these counters; bridged or virtual interfaces (docker0, veth) see the same
  packets as the physical one and are summed with it.
- /sys/class/infiniband/<device>/ports/<port>/: PortXmitData and PortRcvData, which the
  InfiniBand spec counts in 4-byte words ("octets divided by 4"): multiplied by 4 here.
  The 64-bit counters_ext/port_{xmit,rcv}_data_64 (or hw_counters/, same names) when the
  driver has them, else counters/port_{xmit,rcv}_data (64-bit on current kernels, which
  read the extended PMA counters; 32-bit on old ones, which saturate: then NaN). Covers
  RoCE ports too.
Where a source does not exist its rates are NaN and `unavailable` says what was tried.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC_ROOT = Path("/proc")
IB_ROOT = Path("/sys/class/infiniband")
IB_BYTES_PER_WORD = 4  # port_{xmit,rcv}_data count 4-byte words
_WRAP_32 = 2**32


@dataclass(frozen=True)
class NodeRates:
    net_rx_bytes_per_s: float = math.nan
    net_tx_bytes_per_s: float = math.nan
    ib_rx_bytes_per_s: float = math.nan
    ib_tx_bytes_per_s: float = math.nan


@dataclass(frozen=True)
class NodeTotals:
    """Bytes moved since the counters were opened (NaN: no source), at `time_s` (monotonic)."""

    time_s: float
    net_rx_bytes: float = math.nan
    net_tx_bytes: float = math.nan
    ib_rx_bytes: float = math.nan
    ib_tx_bytes: float = math.nan

    def rates_since(self, before: NodeTotals) -> NodeRates:
        dt = self.time_s - before.time_s
        if dt <= 0:
            return NodeRates()
        return NodeRates(
            (self.net_rx_bytes - before.net_rx_bytes) / dt,
            (self.net_tx_bytes - before.net_tx_bytes) / dt,
            (self.ib_rx_bytes - before.ib_rx_bytes) / dt,
            (self.ib_tx_bytes - before.ib_tx_bytes) / dt,
        )


class _Counter:
    """One cumulative hardware counter, accumulated across wraps and resets.

    A 64-bit counter that goes down was reset (interface re-created, counters cleared): the
    new value is what moved since. A counter that has never exceeded 32 bits and goes down
    is taken as a 32-bit counter that wrapped.
    """

    def __init__(self, value: int) -> None:
        self._last = value
        self.total = 0

    def update(self, value: int) -> None:
        if value >= self._last:
            self.total += value - self._last
        elif self._last < _WRAP_32:
            self.total += value + _WRAP_32 - self._last
        else:
            self.total += value
        self._last = value


class _NetDev:
    """/proc/net/dev, every interface but loopback."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._counters: dict[tuple[str, str], _Counter] = {}
        self.totals()  # raises OSError / ValueError if the file is missing or unreadable

    def _read(self) -> dict[str, dict[str, int]]:
        lines = self._path.read_text().splitlines()
        # Header: "Inter-|   Receive ... |  Transmit", then " face |bytes packets ...|bytes ...".
        _, receive, transmit = lines[1].split("|")
        names = [f"rx_{n}" for n in receive.split()] + [f"tx_{n}" for n in transmit.split()]
        interfaces = {}
        for line in lines[2:]:
            name, _, numbers = line.partition(":")
            interfaces[name.strip()] = dict(zip(names, map(int, numbers.split()), strict=True))
        return interfaces

    def totals(self) -> tuple[float, float]:
        """(received, transmitted) bytes since opened, summed over the interfaces (one that
        has gone keeps what it counted; one that appears starts from its current value)."""
        for name, fields in self._read().items():
            if name == "lo":
                continue
            for way in ("rx", "tx"):
                value = fields[f"{way}_bytes"]
                self._counters.setdefault((name, way), _Counter(value)).update(value)
        rx = sum(c.total for (_, way), c in self._counters.items() if way == "rx")
        tx = sum(c.total for (_, way), c in self._counters.items() if way == "tx")
        return float(rx), float(tx)


def _port_data_files(port: Path) -> tuple[Path, Path] | None:
    """(receive, transmit) data-word counter files of an InfiniBand port, 64-bit first."""
    for folder, suffix in (("counters_ext", "_64"), ("hw_counters", "_64"), ("counters", "")):
        rcv = port / folder / f"port_rcv_data{suffix}"
        xmit = port / folder / f"port_xmit_data{suffix}"
        if rcv.exists() and xmit.exists():
            return rcv, xmit
    return None


class _InfiniBand:
    """Every port of every device under the InfiniBand sysfs root."""

    def __init__(self, root: Path) -> None:
        ports = sorted(root.glob("*/ports/*"))
        self._files = [f for f in map(_port_data_files, ports) if f is not None]
        if not self._files:
            raise FileNotFoundError(f"no port_rcv_data/port_xmit_data under {root}/*/ports/*")
        self._counters = [
            (_Counter(_read_int(rcv)), _Counter(_read_int(xmit))) for rcv, xmit in self._files
        ]

    def totals(self) -> tuple[float, float]:
        rx = tx = 0.0
        for (rcv, xmit), (rx_counter, tx_counter) in zip(self._files, self._counters, strict=True):
            rx += _add(rx_counter, _read_int(rcv))
            tx += _add(tx_counter, _read_int(xmit))
        return rx * IB_BYTES_PER_WORD, tx * IB_BYTES_PER_WORD


def _add(counter: _Counter, value: int) -> float:
    """Update `counter`; its total, or NaN once a 32-bit PortCounters value saturated (the
    InfiniBand spec has those stop at their maximum rather than wrap)."""
    counter.update(value)
    return math.nan if value == _WRAP_32 - 1 else float(counter.total)


def _read_int(path: Path) -> int:
    return int(path.read_text())


class NodeCounters:
    """The node's network counters; `read()` gives rates since the previous read.

        counters = NodeCounters()
        time.sleep(1)
        counters.read().net_rx_bytes_per_s   # bytes/s received over the last second

    Reads files: call it from a background thread, never from the training step.
    """

    def __init__(
        self,
        proc_root: Path | None = None,
        ib_root: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` stamps the totals (seconds; tests inject one that moves as told)."""
        self._clock = clock
        proc_root = PROC_ROOT if proc_root is None else proc_root
        ib_root = IB_ROOT if ib_root is None else ib_root
        reasons = []
        self._net: _NetDev | None = None
        self._ib: _InfiniBand | None = None
        try:
            self._net = _NetDev(proc_root / "net" / "dev")
        except (OSError, ValueError, IndexError) as e:
            reasons.append(f"net: {proc_root / 'net' / 'dev'}: {e}")
        try:
            self._ib = _InfiniBand(ib_root)
        except (OSError, ValueError) as e:
            reasons.append(f"ib: {e}")
        self.unavailable = "; ".join(reasons)
        self.available = self._net is not None or self._ib is not None
        self._last = self.totals()

    def totals(self) -> NodeTotals:
        now = self._clock()
        net = self._net.totals() if self._net else (math.nan, math.nan)
        ib = self._ib.totals() if self._ib else (math.nan, math.nan)
        return NodeTotals(now, *net, *ib)

    def read(self) -> NodeRates:
        """Byte rates since the previous read (or since construction)."""
        totals = self.totals()
        rates = totals.rates_since(self._last)
        self._last = totals
        return rates
