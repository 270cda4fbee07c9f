"""Print every value hooks/power.py reads through NVML, and the node counters, on this machine.

    python bench/nvml_probe.py [--seconds 2]

For checking on a real GPU what the unit tests can only fake: which NVML queries this
driver answers, the raw NVLink counters (all links summed, and link by link), the decoded
throttle reasons, and a PowerSampler reading taken while the GPU multiplies matrices.
Exits 0 with a message when there is no GPU or no NVML.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from trainvitals.hooks import power
from trainvitals.hooks.node import NodeCounters


def _reason_names(nvml, mask: int) -> list[str]:
    prefix = "nvmlClocksEventReason"
    if not hasattr(nvml, f"{prefix}GpuIdle"):
        prefix = "nvmlClocksThrottleReason"
    names = [
        name.removeprefix(prefix)
        for name in dir(nvml)
        if name.startswith(prefix) and name not in (f"{prefix}All", f"{prefix}None")
    ]
    return sorted(
        {n for n in names if (getattr(nvml, prefix + n) & mask) and n != "UserDefinedClocks"}
    )


def _print_nvlink(nvml, handle) -> None:
    fields = {
        "DATA_RX": nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        "DATA_TX": nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
    }
    values = nvml.nvmlDeviceGetFieldValues(
        handle, [(f, power.NVML_ALL_LINKS) for f in fields.values()]
    )
    for name, v in zip(fields, values, strict=True):
        print(f"  NVLINK_THROUGHPUT_{name} (all links): return {v.nvmlReturn}, "
              f"type {v.valueType}, {power._field_value(nvml, v)} KiB")  # fmt: skip
    count = nvml.nvmlDeviceGetFieldValues(handle, [nvml.NVML_FI_DEV_NVLINK_LINK_COUNT])[0]
    links = int(power._field_value(nvml, count)) if count.nvmlReturn == 0 else 0
    print(f"  NVLink links: {links if count.nvmlReturn == 0 else f'unknown ({count.nvmlReturn})'}")
    for link in range(links):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError as e:
            state = f"error {e}"
        per_link = nvml.nvmlDeviceGetFieldValues(handle, [(f, link) for f in fields.values()])
        kib = [power._field_value(nvml, v) for v in per_link]
        print(f"    link {link}: state {state}, rx {kib[0]} KiB, tx {kib[1]} KiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="sampling window")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("nvml_probe: no CUDA device here; nothing to probe.")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    source, why = power.open_source(device, local_rank=0)
    if not isinstance(source, power._Nvml):
        print(f"nvml_probe: NVML is not available ({why}); nothing to probe.")
        return 0
    nvml, handle = source._nvml, source._handle
    driver = nvml.nvmlSystemGetDriverVersion()
    print(f"device: {torch.cuda.get_device_name(device)}; driver {driver}")
    print(f"energy since driver load: {source.energy_j():.1f} J")
    state = source.state()
    for name, value in vars(state).items():
        print(f"  {name}: {value}")
    if isinstance(state.throttle_reasons, int):
        print(f"  throttle reasons: {_reason_names(nvml, state.throttle_reasons) or 'none'}")
    try:
        _print_nvlink(nvml, handle)
    except nvml.NVMLError as e:  # the probe reports what the driver says, whatever it is
        print(f"  NVLink fields: {e}")

    sampler = power.PowerSampler(device, local_rank=0, interval_s=0.1)
    print(f"sampler: source {sampler.source!r}; node: {sampler.node_unavailable or 'all there'}")
    sampler.read()
    x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        for _ in range(20):
            x = (x @ x.T) / 8192
        torch.cuda.synchronize()
    for name, value in vars(sampler.read()).items():
        print(f"  {name}: {value}")
    sampler.close()
    counters = NodeCounters()
    time.sleep(0.5)
    print(f"node counters: {counters.read()} ({counters.unavailable or 'all there'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
