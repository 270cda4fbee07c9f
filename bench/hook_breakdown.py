"""Where the hooks' cost goes: host time and device time of each hook, per step.

bench/hook_overhead.py says how much the hooks add to a step; this says which part of them
adds it, and whether it is host work (Python, op dispatch, kernel launches) or device work
(the kernels themselves). A step whose host sets the pace pays the first in full; a step
whose device sets the pace pays the second.

One process, the reference model with a monitor at the default interval. Each hook entry
point (layer hooks, model hook, `monitor.step()`, optimizer hooks) is wrapped and timed:
- host: wall time of the call (`time.perf_counter`), the device never waited for;
- device (CUDA only, a second pass): CUDA events around the call, with the device kept busy
  by a `torch.cuda._sleep` kernel queued just before, so that the events measure the
  hook's kernels and not the device idling while the host runs the hook's Python.

    python bench/hook_breakdown.py                                   # CPU, tiny model
    python bench/hook_breakdown.py --preset 125m --batch 16          # one GPU

On CUDA the block outputs are read on the monitor's own stream, beside the backward
(ActivationMeter._read_beside): their kernels are not in the hook rows, which hold what the training
stream runs; the "side stream" row has their device time, overlapped with the backward (not
added to the total: bench/hook_overhead.py says what the overlap leaves).

Not in the table: what the monitor's background threads (export, power sampling) cost the
training thread by holding the GIL, and the module's forward-hook dispatch around each
layer hook. bench/hook_overhead.py measures those with the rest.

Prints a table per step kind (unlogged, logged) and, on its last line, the hooks' host and
device time per step at the default interval.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from hook_overhead import DEFAULT_EVERY, Trainee  # bench/ is on sys.path when run as a script

from trainvitals.hooks import monitor as monitor_module
from trainvitals.hooks import timing

try:
    from trainvitals.hooks import update
except ImportError:  # an older version of the hooks, before update.py
    update = None
from trainvitals.trainer.model import PRESETS

try:  # the block-output hooks: their own meter since the Monitor was split into stages
    from trainvitals.hooks.activations import ActivationMeter as Reader
except ImportError:  # an older version of the hooks: they were the Monitor's
    Reader = monitor_module.Monitor

# The hooks' entry points: (owner class, method, label). Per-layer hooks are closures made
# by _activation_hook at attach, so that factory is wrapped instead.
ENTRY_POINTS = (
    (Reader, "_read_outputs", "read block outputs (model forward hook)"),
    (monitor_module.Monitor, "step", "monitor.step()"),
    (timing.StepTimer, "_forward_start", "step timer, forward pre-hook"),
    (timing.StepTimer, "_optimizer_end", "step timer, optimizer post-hook"),
)
if update is not None:
    ENTRY_POINTS += (
        (update.UpdateMeter, "_pre_step", "update RMS, optimizer pre-hook (copy)"),
        (update.UpdateMeter, "_post_step", "update RMS, optimizer post-hook (norms)"),
    )
LAYER_HOOKS = "collect block outputs (layer forward hooks)"
SIDE = "side stream: block-output reads (overlapped)"


class Clock:
    """Host seconds, and on CUDA device seconds, spent in each wrapped call, by label and by
    whether the step is a logged one."""

    def __init__(self, device_pass: bool, sleep_cycles: int) -> None:
        self.device_pass = device_pass
        self.sleep_cycles = sleep_cycles
        self.logged = False  # set by the driver before each step
        self.active = True  # off while the plain copy steps
        self.host_s: dict[tuple[str, bool], float] = defaultdict(float)
        self.events: dict[tuple[str, bool], list] = defaultdict(list)

    def timed(self, label: str, fn):
        def call(*args, **kwargs):
            if not self.active:  # the plain copy's optimizer runs the global post-hook too
                return fn(*args, **kwargs)
            key = (label, self.logged)
            if self.device_pass:
                torch.cuda._sleep(self.sleep_cycles)  # the device stays ahead of the host
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            self.host_s[key] += time.perf_counter() - t0
            if self.device_pass:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.events[key].append((start, end))
            return result

        return call

    def timed_side(self, fn):
        """Device time of the block-output read (_read) when it runs on the monitor's side
        stream (events on that stream, after its wait for the training stream)."""

        def call(monitor, *args, **kwargs):
            side = getattr(monitor, "_side", None)
            if not (self.active and self.device_pass) or torch.cuda.current_stream() != side:
                return fn(monitor, *args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(side)
            result = fn(monitor, *args, **kwargs)
            end.record(side)
            self.events[(SIDE, self.logged)].append((start, end))
            return result

        return call

    def device_s(self) -> dict[tuple[str, bool], float]:
        torch.cuda.synchronize()  # bench boundary
        return {
            key: sum(s.elapsed_time(e) for s, e in pairs) / 1e3
            for key, pairs in self.events.items()
        }


def patch(clock: Clock) -> list:
    """Wrap the entry points (before attach: the hooks bind them when registered)."""
    # Entry points an older version of the hooks lacks are left out (to compare versions).
    present = [e for e in ENTRY_POINTS if hasattr(e[0], e[1])]
    for owner, name, _ in ENTRY_POINTS:
        if not hasattr(owner, name):  # said, so that a renamed hook is not silently missed
            print(f"left out: {owner.__name__}.{name} (not in these hooks)")
    undo = [(owner, name, getattr(owner, name)) for owner, name, _ in present]
    for owner, name, label in present:
        setattr(owner, name, clock.timed(label, getattr(owner, name)))  # binds like a method
    if hasattr(Reader, "_read_beside"):
        read = Reader._read
        undo.append((Reader, "_read", read))
        Reader._read = clock.timed_side(read)
    factory = Reader._activation_hook
    undo.append((Reader, "_activation_hook", factory))
    Reader._activation_hook = lambda self, i: clock.timed(LAYER_HOOKS, factory(self, i))
    return undo


def run_pass(args, device: torch.device, device_pass: bool) -> tuple[Clock, float]:
    """Steps of one monitored copy; returns the clock and the median plain step time."""
    clock = Clock(device_pass, int(args.sleep_ms * sleep_cycles_per_ms()) if device_pass else 0)
    undo = patch(clock)
    try:
        return drive(args, device, clock)
    finally:
        for owner, name, original in undo:
            setattr(owner, name, original)


def sleep_cycles_per_ms() -> float:
    """How many cycles of `torch.cuda._sleep` make a millisecond on this device."""
    cycles = 10**8
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()  # bench set-up
    return cycles / start.elapsed_time(end)


def drive(args, device: torch.device, clock: Clock) -> tuple[Clock, float]:
    """The monitored copy's steps, each followed by a plain copy's step (timed)."""
    trainee = Trainee(args, None, device, DEFAULT_EVERY)
    plain = Trainee(args, None, device, None)
    cfg = args.model
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.max_seq_len + 1))
    batch = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))
    clock.active = False
    for _ in range(DEFAULT_EVERY):  # warm-up, not counted
        trainee.step(*batch)
        plain.step(*batch)
    clock.active = True
    clock.host_s.clear()
    clock.events.clear()
    plain_s = []
    for step in range(args.intervals * DEFAULT_EVERY):
        clock.logged = step % DEFAULT_EVERY == 0  # the warm-up left the count at a multiple
        trainee.step(*batch)
        sync(device)
        clock.active, start = False, time.perf_counter()
        plain.step(*batch)
        sync(device)
        clock.active = True
        plain_s.append(time.perf_counter() - start)
    trainee.monitor.close()
    return clock, statistics.median(plain_s)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # bench boundary, outside the hooks


def report(args, host: Clock, device_s: dict | None, plain_step_s: float) -> None:
    per_kind = {True: args.intervals, False: args.intervals * (DEFAULT_EVERY - 1)}
    labels = [LAYER_HOOKS] + [label for *_, label in ENTRY_POINTS]
    total = {"host": 0.0, "device": 0.0}
    for logged in (False, True):
        steps = per_kind[logged]
        print(f"\n{'logged' if logged else 'unlogged'} steps ({steps}): microseconds per step")
        print(f"{'hook':<48} {'host':>9} {'device':>9}")
        for label in labels:
            h = host.host_s.get((label, logged), 0.0) / steps
            d = device_s.get((label, logged), 0.0) / steps if device_s is not None else None
            total["host"] += h * steps
            total["device"] += (d or 0.0) * steps
            dev = f"{d * 1e6:9.0f}" if d is not None else f"{'n/a':>9}"
            print(f"{label:<48} {h * 1e6:9.0f} {dev}")
        if device_s is not None and (SIDE, logged) in device_s:  # host time is in the rows above
            print(f"{SIDE:<48} {'':>9} {device_s[(SIDE, logged)] / steps * 1e6:9.0f}")
    n = args.intervals * DEFAULT_EVERY
    host_ms, device_ms = total["host"] / n * 1e3, total["device"] / n * 1e3
    device = f"{device_ms:.3f} ms device" if device_s is not None else "device n/a (no GPU)"
    print(
        f"\nhooks per step at the default interval (every {DEFAULT_EVERY}), {args.preset} "
        f"batch {args.batch}: {host_ms:.3f} ms host, {device}; plain step "
        f"{plain_step_s * 1e3:.1f} ms"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--intervals", type=int, default=5, help="logging intervals to time")
    p.add_argument(
        "--sleep-ms", type=float, default=20.0, help="CUDA: device busy time queued per call"
    )
    args = p.parse_args()
    if args.batch < 1 or args.intervals < 1 or args.sleep_ms <= 0:
        p.error("--batch, --intervals and --sleep-ms must be positive")
    args.model = PRESETS[args.preset]
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    host, plain_step_s = run_pass(args, device, device_pass=False)
    device_s = None
    if device.type == "cuda":
        timed, _ = run_pass(args, device, device_pass=True)
        device_s = timed.device_s()
    report(args, host, device_s, plain_step_s)


if __name__ == "__main__":
    main()
