"""Fault injection for the reference trainer, with ground truth, so detectors meet real faults.

    --inject straggler:rank=1,step=20,slowdown=0.3   rank 1 computes 30% longer from step 20
    --inject straggler:rank=1,step=20,slowdown=0.3,how=idle
                                                     rank 1 sleeps 30% of its compute time
                                                     in each forward from step 20: off the
                                                     CPU, as under a CPU quota or a slow
                                                     file read (CPU ranks)
    --inject straggler:rank=1,step=20,slowdown=0.3,how=data
                                                     rank 1 waits that long for each batch
                                                     from step 20: a slow file system or a
                                                     starved loader on its node
    --inject straggler:rank=1,step=20,slowdown=0.3,until=80,ramp=40
                                                     from step 20 to step 79, growing to
                                                     30% over its first 40 steps
    --inject straggler:rank=1,step=20,slowdown=10,every=25,how=data
                                                     rank 1 waits 10x its compute time for
                                                     one batch in 25 (hiccups: a shared
                                                     file system's bad moments)
    --inject sdc:rank=2,step=30,fraction=0.001       rank 2 has a faulty unit from step 30: a
                                                     fraction of one op's outputs (and of the
                                                     SDC canary's) come out wrong
    --inject sdc:rank=2,step=30,mode=bitflip         one bit of one weight flips in rank 2's
                                                     memory at step 30 (a replicated weight
                                                     where there is one, so replicas disagree)
    --inject spike:step=50,kind=batch                data window 50 (step 50) is random bytes
    --inject spike:step=50,kind=lr                   one step uses 30x the learning rate
    --inject nan:step=40                             the loss becomes NaN
    --inject crash:rank=3,step=60 / hang:rank=3,step=60
                                                     (where=forward or backward: inside it,
                                                     the others waiting in the model's
                                                     collectives)
    --inject pause:step=30,seconds=45,phase=checkpoint
                                                     every rank pauses 45 s after step 30,
                                                     declared to the monitor as a checkpoint
                                                     save (phase=eval: an evaluation; none:
                                                     undeclared, as a loop that does not say)
                                                     - not a fault: no alert is the answer
    --inject diverge:step=40,growth=1.3              data window 40 tips training into an
                                                     instability: from the step that trains on
                                                     it, the learning rate grows 1.3x a step
                                                     (up to 10,000x) and the loss climbs; tied to
                                                     the data, not the step: a run that skips
                                                     that window (--skip-data) never meets it

A fault of a node's hardware names the node: `sdc:node=node1,rank=0,step=30` (also crash,
hang, straggler) hits local rank 0 of the agent whose TRAINVITALS_NODE is node1 (the
supervisor's agents set it), whatever its global rank; once that node is fenced no rank
meets it again, as with real faulty hardware.

Every rank parses the same specs; rank 0 records each fault as an event (`fault:<kind>`)
at its step, which is the ground truth detectors are scored against. A crash or hang of
one rank is recorded by that rank itself, just before it stops (rank 0 may be the one that
stops, or be killed by torchrun first).

A resumed run (`--resume` found a checkpoint) takes the same specs, since the same command
line serves every restart: a crash or hang does not fire again there (else the job could
never finish), and an SDC unit whose step lies before the resume step is armed again at
once (a faulty unit stays faulty, as a straggler stays slow).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections import deque
from collections.abc import Callable

import torch
from torch import nn

from trainvitals import faultspec
from trainvitals.faultspec import Fault, Param
from trainvitals.hooks.timing import recorded_event

_WHOLE = Param("whole")  # rank, step
_NODE = Param("text", "")  # a fault of one node's hardware: `rank` is local to it
_WHERE = Param("text", "step", choices=("step", "forward", "backward"))
# kind -> its parameters, in the fault language both the trainer and the simulator speak
# (trainvitals/faultspec.py)
KINDS: dict[str, dict[str, Param]] = {
    "straggler": {
        "rank": _WHOLE, "step": _WHOLE, "node": _NODE,
        "slowdown": Param("number", low=0, high=10, words="in (0, 10]"),
        "how": Param("text", "busy", choices=("busy", "idle", "data")),
        **faultspec.STRAGGLER_SCHEDULE,
    },
    "sdc": {
        "rank": _WHOLE, "step": _WHOLE, "node": _NODE,
        "fraction": Param("number", 0.001, low=0, high=1, words="in (0, 1]"),
        "mode": Param("text", "unit", choices=("unit", "bitflip")),
    },
    "spike": {"step": _WHOLE, "kind": Param("text", "batch", choices=("batch", "lr"))},
    "nan": {"step": _WHOLE},
    # where: between steps (after the monitor's step), or inside the forward or the
    # backward (its first block's feed-forward), where the others wait for it in the
    # model's collectives
    "crash": {"rank": _WHOLE, "step": _WHOLE, "node": _NODE, "where": _WHERE},
    "hang": {"rank": _WHOLE, "step": _WHOLE, "node": _NODE, "where": _WHERE},
    "diverge": {"step": _WHOLE, "growth": Param("number", 1.3, low=1, high=10, words="in (1, 10]")},
    "pause": {
        "step": _WHOLE,
        "seconds": Param("number", low=0, high=3600, words="in (0, 3600]"),
        "phase": Param("text", "checkpoint", choices=("checkpoint", "eval", "none")),
    },
}  # fmt: skip
NODE_ENV = "TRAINVITALS_NODE"  # the name of the node (agent) a rank runs on
LR_SPIKE_FACTOR = 30.0
DIVERGE_MAX_FACTOR = 1e4  # the diverge fault's learning-rate factor stops growing here
BITFLIP_BIT = 20  # a float32 mantissa bit: the weight changes by a few percent, nothing blows up


def parse_fault(spec: str) -> Fault:
    """'straggler:rank=1,step=20,slowdown=0.3' -> Fault. ValueError names what is wrong."""
    return faultspec.parse_fault(spec, KINDS, flag="--inject")


def _node(f: Fault) -> str:
    """The node a fault names ('': none; its rank is global)."""
    return str(f.params.get("node", ""))


def _self_told(f: Fault) -> bool:
    """A crash or hang of one global rank: that rank records it itself, as it stops."""
    return f.kind in ("crash", "hang") and f.rank >= 0 and not _node(f)


def _poisons(f: Fault, data_index: int) -> bool:
    """A diverge fault: whether `data_index` is its bad data window."""
    return f.kind == "diverge" and data_index == f.step


def _detail(f: Fault) -> dict:
    """A fault's parameters for its ground-truth event (rank and step are the event's own)."""
    detail = {k: v for k, v in f.params.items() if v != ""}
    if _node(f):
        detail["local_rank"] = f.rank
    if detail.get("mode") == "bitflip":
        del detail["fraction"]  # a bit flip changes one bit, not a fraction
    return detail


def corrupt(t: torch.Tensor, fraction: float, seed: int = 7) -> torch.Tensor:
    """A faulty unit's output: a fixed `fraction` of the elements come out 8x too large, negated."""
    gen = torch.Generator(device=t.device).manual_seed(seed)
    mask = torch.rand(t.shape, generator=gen, device=t.device) < fraction
    return torch.where(mask, -8.0 * t, t)


def flip_bit(param: torch.Tensor, bit: int) -> None:
    """Flip one bit of the first element of this rank's (local shard of the) float32 weight."""
    t = param.to_local() if hasattr(param, "to_local") else param
    with torch.no_grad():
        t.view(torch.int32).view(-1)[0] ^= 1 << bit


class FaultInjector:
    """Applies the faults that concern this rank at the right steps.

    first_step: the step a resumed run starts at (0: a fresh run). node, local_rank: where
    this rank runs (default: $TRAINVITALS_NODE and $LOCAL_RANK), for faults that name a node.
    """

    def __init__(
        self,
        specs: list[str],
        rank: int,
        world_size: int,
        device: torch.device | None = None,
        first_step: int = 0,
        node: str | None = None,
        local_rank: int | None = None,
    ) -> None:
        self.faults = [parse_fault(s) for s in specs]
        for f in self.faults:
            if f.rank >= world_size:
                raise ValueError(f"--inject {f.kind}: rank {f.rank} >= world size {world_size}")
            until = f.params.get("until", 0)
            if until and until <= f.step:
                raise ValueError(
                    f"--inject {f.kind}: until ({until}) must come after step ({f.step})"
                )
        self.rank = rank
        self.node = os.environ.get(NODE_ENV, "") if node is None else node
        self.local_rank = (
            int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        )
        self.first_step = first_step
        self._diverging: tuple[int, float] | None = None  # (step, growth) of a diverge fault
        self.clock = ComputeClock(device or torch.device("cpu"))
        self._step = first_step  # the step in progress (arm_idle), for an idle straggler

    def _fires(self, f: Fault) -> bool:
        """False for a crash or hang in a resumed run: it fired in the run before."""
        return not (self.first_step > 0 and f.kind in ("crash", "hang"))

    def _hits_me(self, f: Fault) -> bool:
        if _node(f):  # a faulty part of one node: its local rank there
            return _node(f) == self.node and f.rank == self.local_rank
        return f.rank in (-1, self.rank)

    def _mine(self, kind: str, step: int, started: bool = False) -> list[Fault]:
        return [
            f for f in self.faults
            if f.kind == kind and self._hits_me(f)
            and (step >= f.step if started else step == f.step)
        ]  # fmt: skip

    def record(self, monitor, step: int) -> None:
        """Rank 0 writes the ground truth of every fault that starts at `step`, but for a
        crash or hang of one rank, which that rank writes itself (crash_or_hang): two
        senders of one key would send two times, and the store keeps the first. A fault of
        a node rank 0 does not know the global rank of is recorded with rank -1, the node
        in its detail."""
        if self.rank == 0:
            for f in self.faults:
                if f.step == step and self._fires(f) and f.kind != "diverge" and not _self_told(f):
                    monitor.event(f"fault:{f.kind}", step, -1 if _node(f) else f.rank, _detail(f))

    def record_data(self, monitor, step: int, data_index: int) -> None:
        """Rank 0 records a bad data window's first batch where a step meets it."""
        if self.rank == 0:
            for f in self.faults:
                if _poisons(f, data_index):
                    detail = {**_detail(f), "data_index": data_index}
                    monitor.event("fault:diverge", step, -1, detail)

    def arm_sdc(self, model: nn.Module, monitor, step: int) -> None:
        """From its step on, this rank computes wrong values in one op and in its canary;
        or, for a bit flip, one bit of one weight flips once, now. A resumed run arms a
        unit whose step lies before it at its first step; a flipped bit is in the checkpoint."""
        rearm = [
            f for f in self._mine("sdc", step, started=True)
            if step == self.first_step and f.step < step and f.params["mode"] == "unit"
        ]  # fmt: skip
        for f in self._mine("sdc", step) + rearm:
            if f.params["mode"] == "bitflip":
                replicas = getattr(getattr(monitor, "replica", None), "tensors", None)
                flip_bit(replicas[0] if replicas else next(model.parameters()), BITFLIP_BIT)
                continue
            block = next(m for name, m in model.named_modules() if name.endswith("feed_forward"))
            block.register_forward_hook(lambda _m, _i, out, p=f.params: corrupt(out, p["fraction"]))
            if monitor.canary is not None:  # None when the hooks are off
                monitor.canary.fault = lambda out, p=f.params: corrupt(out, p["fraction"])

    def batch(
        self,
        step: int,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        data_index: int = -1,
        dp_rank: int = 0,
        dp: int = 1,
    ):
        """The step's batch; random bytes for a batch spike (nothing to learn from them).
        data_index: which window of the data it is (trainer/data.py). The random global
        batch is drawn whole and sliced by data-parallel rank, like the real one, so that
        any dp sees the same bytes (a re-run on fewer ranks meets the same batch)."""
        for f in self.faults:
            if _poisons(f, data_index) and self._diverging is None:
                self._diverging = (step, f.params["growth"])
        # A batch spike is a bad batch: tied to the data window (the step, unless windows
        # are skipped), so a re-run of the step meets it again and a skip avoids it.
        window = step if data_index < 0 else data_index
        if any(f.params["kind"] == "batch" for f in self._mine("spike", window)):
            gen = torch.Generator().manual_seed(window)
            rows = inputs.shape[0]
            noise = torch.randint(0, 256, (rows * dp, inputs.shape[1] + 1), generator=gen)
            noise = noise[dp_rank * rows : (dp_rank + 1) * rows]
            return noise[:, :-1].to(inputs.device), noise[:, 1:].to(targets.device)
        return inputs, targets

    def lr_factor(self, step: int) -> float:
        hit = any(f.params["kind"] == "lr" for f in self._mine("spike", step))
        factor = LR_SPIKE_FACTOR if hit else 1.0
        if self._diverging is not None:  # an instability since the bad data window
            since, growth = self._diverging
            factor *= min(DIVERGE_MAX_FACTOR, growth ** (step - since + 1))
        return factor

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if self._mine("nan", step) else loss

    def slow_down(self, step: int) -> None:
        """A straggler computes `slowdown` x its normal step's compute time more (busy, not
        asleep). Normal: the median of this rank's recent steps without the injected work
        (`self.clock`), so the slowdown does not compound."""
        faults = [
            f for f in self._mine("straggler", step, started=True) if f.params["how"] == "busy"
        ]
        base_s = self.clock.baseline_s() if faults else None
        if base_s is None:
            return  # not slowed, or no step measured yet (the first step of a run)
        for f in faults:
            if slowdown := faultspec.straggler_slowdown(f, step):
                self.clock.busy(slowdown * base_s)

    def arm_idle(self, model: nn.Module, step: int) -> None:
        """From its step on (at once in a resumed run past it), an idle straggler sleeps
        `slowdown` x its normal step's compute time in each forward, in its first block's
        feed-forward: after that block's all-gather, so that the others wait for it in the
        model's next collectives, not at the step's end, and with neither its CPU time
        nor its stopped time moving (a CPU quota, a slow file read, page faults)."""
        self._step = step
        for f in self._mine("straggler", step, started=True):
            armed = f.step == step or step == self.first_step
            if f.params["how"] == "idle" and armed:
                block = next(
                    m for name, m in model.named_modules() if name.endswith("feed_forward")
                )
                block.register_forward_pre_hook(lambda _m, _i, f=f: self._idle(f))

    def _idle(self, f: Fault) -> None:
        base_s = self.clock.baseline_s()
        slowdown = faultspec.straggler_slowdown(f, self._step)
        if base_s is not None and slowdown:
            self.clock.idle(slowdown * base_s)

    def wait_for_data(self, step: int) -> None:
        """A data straggler (`how=data`) waits `slowdown` x its normal step's compute time
        for its batch, between the optimizer step and the forward: where a slow file system
        or a loader short of workers holds a rank back. Off the CPU, and the others wait
        for it in the forward's first collective."""
        base_s = self.clock.baseline_s()
        if base_s is None:
            return  # no step measured yet (the first step of a run)
        for f in self._mine("straggler", step, started=True):
            if f.params["how"] == "data" and (slowdown := faultspec.straggler_slowdown(f, step)):
                self.clock.idle(slowdown * base_s)

    def pause(self, step: int, monitor) -> None:
        """Every rank pauses between steps, as for a slow checkpoint save or an evaluation,
        declared to the monitor as the fault's phase (none: undeclared)."""
        for f in self._mine("pause", step):
            phase = f.params["phase"]
            with contextlib.nullcontext() if phase == "none" else monitor.pause(phase):
                time.sleep(f.params["seconds"])

    def crash_or_hang(self, step: int, monitor) -> None:
        """Crash or hang now, between steps (`where=step`), after the monitor has exported
        what it holds and this rank's own record of the fault (ground truth that must not
        depend on rank 0, which torchrun kills soon after): a real crash would lose it, a
        test harness should not. Rank 0 leaves this one to the rank (record), but for a
        fault on every rank or on a node, which it records as rank -1: another key."""
        hits = [f for f in self._crashes_and_hangs(step) if f.params["where"] == "step"]
        if hits:
            self._stop(hits[0], step, monitor)

    def arm_crash_or_hang(self, model: nn.Module, step: int, monitor) -> None:
        """A crash or hang `where=forward` (or `backward`) stops the rank inside its forward
        (or backward) at its step, in its first block's feed-forward (after that block's
        all-gather), as a deadlock or a runaway loop in the model's code would: the others
        go on to the model's next collectives and wait for it there, mid-step."""
        hits = [f for f in self._crashes_and_hangs(step) if f.params["where"] != "step"]
        if not hits:
            return
        block = next(m for name, m in model.named_modules() if name.endswith("feed_forward"))
        if hits[0].params["where"] == "forward":
            block.register_forward_pre_hook(lambda _m, _i: self._stop(hits[0], step, monitor))
        else:
            block.register_full_backward_pre_hook(lambda _m, _g: self._stop(hits[0], step, monitor))

    def _crashes_and_hangs(self, step: int) -> list[Fault]:
        return [f for f in self._mine("crash", step) + self._mine("hang", step) if self._fires(f)]

    def _stop(self, f: Fault, step: int, monitor) -> None:
        monitor.event(f"fault:{f.kind}", step, self.rank, _detail(f))
        monitor.flush(timeout_s=10)  # blocks: the process is about to stop anyway
        if f.kind == "crash":
            os._exit(17)  # a crashed rank: no cleanup, no goodbye
        else:
            while True:
                time.sleep(3600)


class ComputeClock:
    """This rank's time per step, without injected work: the straggler's baseline.

    One step spans `start()` (before the batch) to `end()` (after the optimizer step). CPU:
    the training thread's CPU time, less the injected busy time. CUDA: the host's wall time,
    less the injected busy time. Device time alone would not do: a step that is partly
    host-bound leaves the device idle between kernels, a device sleep fills those gaps
    first, and on an H200 a +50% sleep slowed such a step by 14% only.
    """

    WINDOW = 16  # steps in the median: enough to ride out a hiccup, recent enough to follow drift
    # torch.cuda._sleep counts clock cycles: about 1.5e9 per second on data-centre GPUs, then
    # corrected by each measured sleep.
    CUDA_CYCLES_PER_S = 1.5e9

    def __init__(self, device: torch.device, clock: Callable[[], float] | None = None) -> None:
        """clock: seconds, for the CPU path (tests inject one); default the thread's CPU time."""
        self.cuda = device.type == "cuda"
        self.samples: deque[float] = deque(maxlen=self.WINDOW)  # seconds per step
        self.cycles_per_s = self.CUDA_CYCLES_PER_S
        self._start_s = 0.0
        self._busy_s = 0.0
        self._now_s = clock or (time.perf_counter if self.cuda else time.thread_time)

    def start(self) -> None:
        self._start_s, self._busy_s = self._now_s(), 0.0

    def end(self) -> None:
        self.samples.append(self._now_s() - self._start_s - self._busy_s)

    def baseline_s(self) -> float | None:
        """Median seconds of this rank's recent steps without injected work; None before
        the first measured step."""
        return statistics.median(self.samples) if self.samples else None

    def idle(self, seconds: float) -> None:
        """Sleep `seconds`: injected, so not this rank's own time. The CPU clock does not
        count a sleep; the CUDA path's wall clock does, and takes it out."""
        start = time.perf_counter()
        time.sleep(seconds)
        if self.cuda:
            self._busy_s += time.perf_counter() - start

    def busy(self, seconds: float) -> None:
        """Keep this rank busy for about `seconds` more per step (a slow device, not an idle
        one: on CUDA the device sleeps)."""
        if self.cuda:
            self._busy_s += self._sleep_device(seconds)
            return
        # A plain spin on this thread's CPU clock: a matmul here let torch's intra-op
        # threads spin-wait on a loaded machine, so one iteration overshot by milliseconds
        # and the injected work came out 1.8x what was asked.
        start = self._now_s()
        end = start + seconds
        while self._now_s() < end:
            pass
        self._busy_s += self._now_s() - start

    def _sleep_device(self, seconds: float) -> float:
        """Sleep the device for about `seconds`; returns the seconds it slept. Only the sleep
        counts as injected, not the host's wait: a device-bound step's host waits for its
        queued work here instead of later, and that wait is the step's own time."""
        cycles = int(seconds * self.cycles_per_s)
        before = recorded_event()
        torch.cuda._sleep(cycles)
        after = recorded_event()
        # sync point: the fault's own, not the hooks'. The host waits out the sleep, so a
        # host-bound step slows by what was asked instead of the sleep filling idle gaps.
        after.synchronize()
        slept_s = before.elapsed_time(after) / 1e3  # ms -> s
        if slept_s > 0:
            self.cycles_per_s = cycles / slept_s
        return slept_s
