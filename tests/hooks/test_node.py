"""Node network counters: the real /proc/net/dev of this machine, and recorded layouts of
/proc/net/dev and /sys/class/infiniband in a temporary folder.

This machine has no InfiniBand device, so the InfiniBand tests read a copy of the sysfs
layout (device/ports/N/counters/port_rcv_data ...) written to tmp_path: the only stand-in.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from trainvitals.hooks.node import NodeCounters, NodeTotals

HEADER = (
    "Inter-|   Receive                                                |  Transmit\n"
    " face |bytes    packets errs drop fifo frame compressed multicast"
    "|bytes    packets errs drop fifo colls carrier compressed\n"
)


def _net_dev(root: Path, interfaces: dict[str, tuple[int, int]]) -> Path:
    """Write root/net/dev with (rx_bytes, tx_bytes) per interface; other fields made up."""
    lines = [
        f"{name:>6}: {rx} 7 0 0 0 0 0 0 {tx} 5 0 0 0 0 0 0\n"
        for name, (rx, tx) in interfaces.items()
    ]
    (root / "net").mkdir(parents=True, exist_ok=True)
    (root / "net" / "dev").write_text(HEADER + "".join(lines))
    return root


def _ib_port(root: Path, device: str, port: int, folder: str, rcv: int, xmit: int) -> None:
    suffix = "_64" if folder == "counters_ext" else ""
    counters = root / device / "ports" / str(port) / folder
    counters.mkdir(parents=True, exist_ok=True)
    (counters / f"port_rcv_data{suffix}").write_text(f"{rcv}\n")
    (counters / f"port_xmit_data{suffix}").write_text(f"{xmit}\n")


def test_real_proc_net_dev_gives_finite_rates() -> None:
    counters = NodeCounters()
    time.sleep(0.2)
    rates = counters.read()
    assert rates.net_rx_bytes_per_s >= 0 and math.isfinite(rates.net_rx_bytes_per_s)
    assert rates.net_tx_bytes_per_s >= 0 and math.isfinite(rates.net_tx_bytes_per_s)


def test_net_sums_interfaces_but_loopback(tmp_path: Path) -> None:
    proc = _net_dev(tmp_path, {"lo": (10**9, 10**9), "eth0": (1000, 2000), "eth1": (5, 6)})
    counters = NodeCounters(proc_root=proc, ib_root=tmp_path / "no-ib")
    assert counters.available and counters.unavailable.startswith("ib:")
    _net_dev(tmp_path, {"lo": (2 * 10**9, 10**9), "eth0": (1600, 2100), "eth1": (5, 6)})
    totals = counters.totals()
    assert (totals.net_rx_bytes, totals.net_tx_bytes) == (600.0, 100.0)
    assert math.isnan(totals.ib_rx_bytes) and math.isnan(totals.ib_tx_bytes)


def test_net_interface_that_goes_or_comes_does_not_jump(tmp_path: Path) -> None:
    _net_dev(tmp_path, {"eth0": (1000, 1000)})
    counters = NodeCounters(proc_root=tmp_path, ib_root=tmp_path / "no-ib")
    _net_dev(tmp_path, {"eth0": (1100, 1000)})
    assert counters.totals().net_rx_bytes == 100
    _net_dev(tmp_path, {"veth9": (10**6, 10**6)})  # eth0 gone, veth9 new
    assert counters.totals().net_rx_bytes == 100
    _net_dev(tmp_path, {"veth9": (10**6 + 7, 10**6)})
    assert counters.totals().net_rx_bytes == 107


def test_ib_counts_4_byte_words_and_prefers_64_bit_counters(tmp_path: Path) -> None:
    ib = tmp_path / "infiniband"
    _ib_port(ib, "mlx5_0", 1, "counters", rcv=100, xmit=200)
    _ib_port(ib, "mlx4_0", 1, "counters", rcv=10**9, xmit=10**9)  # ignored: _64 exists
    _ib_port(ib, "mlx4_0", 1, "counters_ext", rcv=10**12, xmit=10**12)
    counters = NodeCounters(proc_root=_net_dev(tmp_path, {}), ib_root=ib)
    _ib_port(ib, "mlx5_0", 1, "counters", rcv=150, xmit=260)
    _ib_port(ib, "mlx4_0", 1, "counters", rcv=0, xmit=0)
    _ib_port(ib, "mlx4_0", 1, "counters_ext", rcv=10**12 + 1000, xmit=10**12 + 10)
    totals = counters.totals()
    assert totals.ib_rx_bytes == 4 * (50 + 1000)
    assert totals.ib_tx_bytes == 4 * (60 + 10)


def test_ib_32_bit_wrap_64_bit_reset_and_saturation(tmp_path: Path) -> None:
    ib = tmp_path / "infiniband"
    _ib_port(ib, "old", 1, "counters", rcv=2**32 - 100, xmit=2**40)
    counters = NodeCounters(proc_root=tmp_path / "no-proc", ib_root=ib)
    assert "net:" in counters.unavailable
    _ib_port(ib, "old", 1, "counters", rcv=50, xmit=30)  # rcv wrapped; xmit was reset
    totals = counters.totals()
    assert totals.ib_rx_bytes == 4 * 150 and totals.ib_tx_bytes == 4 * 30
    _ib_port(ib, "old", 1, "counters", rcv=2**32 - 1, xmit=40)  # a 32-bit counter stuck at max
    totals = counters.totals()
    assert math.isnan(totals.ib_rx_bytes) and totals.ib_tx_bytes == 4 * 40


def test_rates_are_bytes_per_second_between_totals() -> None:
    before = NodeTotals(10.0, 0.0, 0.0, 0.0, 0.0)
    after = NodeTotals(12.0, 4000.0, 1000.0, 2.0, math.nan)
    rates = after.rates_since(before)
    assert (rates.net_rx_bytes_per_s, rates.net_tx_bytes_per_s) == (2000.0, 500.0)
    assert rates.ib_rx_bytes_per_s == 1.0 and math.isnan(rates.ib_tx_bytes_per_s)
    assert math.isnan(after.rates_since(after).net_rx_bytes_per_s)


def test_nothing_there_says_what_was_tried(tmp_path: Path) -> None:
    counters = NodeCounters(proc_root=tmp_path / "no-proc", ib_root=tmp_path / "no-ib")
    assert not counters.available
    assert "net:" in counters.unavailable and "ib:" in counters.unavailable
    rates = counters.read()
    assert all(math.isnan(v) for v in vars(rates).values())


@pytest.mark.parametrize("bad", ["", "Inter-|\n"])
def test_unreadable_net_dev_is_reported(tmp_path: Path, bad: str) -> None:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "dev").write_text(bad)
    counters = NodeCounters(proc_root=tmp_path, ib_root=tmp_path / "no-ib")
    assert "net:" in counters.unavailable
