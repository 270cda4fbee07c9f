"""Faults applied from outside the trainer, on real runs: are they named, and by whom?

The liveness and straggler detectors were scored with faults the trainer injects into
itself (bench/liveness.py, bench/detect.py), each announced by a `fault:*` event. Real
faults come from outside: the OOM killer, a frozen node, a noisy neighbour, a collector
restart. Here the bench starts `trainvitals collector` on 127.0.0.1 (a subprocess on an
explicit `--port`, default liveness and straggler settings), runs the reference trainer on
4 CPU ranks (torchrun, gloo, dp 4, `--log-every 10`, OMP_NUM_THREADS=1) against it, and
applies each fault with OS signals from this process. The rank processes are the
trainer's processes (its own session) whose environment holds RANK. Ground truth is the
bench's own clock and the run's latest logged step (GET /api/v1/runs) when it applied the
fault; the trainer sends no event for it. Alerts are read from GET
/api/v1/runs/{run}/alerts every 0.5 s; an alert's latency is from the fault to the poll
that first read it.

Scenarios and what is expected of them:
- kill9: SIGKILL of rank 2 mid-run: rank_lost naming rank 2 within 30 s, and no alert
  naming another rank first;
- sigstop: SIGSTOP of rank 1 for 60 s, then SIGCONT: rank_lost or hang naming rank 1
  within 60 s, resolved after SIGCONT, and the run completes;
- node_loss: SIGKILL of the 4 ranks and the torchrun agent at once: rank_lost within 30 s;
- throttle25, throttle12, throttle50: rank 3 stopped D ms of every 100 ms (D = 25, 12;
  50 beyond the brief, to see whether a harsher throttle is named) for 150 steps in the
  middle of the run: straggler naming rank 3, resolved after the throttle ends,
  nothing else; its latency in steps from the throttle's start, and the slowdown the
  throttle caused, from the per-rank step telemetry (GET /api/v1/runs/{run}/ranks/grid);
- freeze30, quota10 (added later, by the detectors' author, root only): rank 3 frozen 30 ms
  of every 100 ms by the cgroup v1 freezer (`docker pause`'s mechanism), and rank 3 held
  to 10% of a CPU by a CFS quota (a container's CPU limit): the same expectation;
- control_inject25 (beyond the brief): the positive control, the trainer's own
  `--inject straggler:rank=3,...,slowdown=0.25` on the same layout and log interval;
- collector_restart: SIGTERM of the collector during a clean run (at logged step
  --restart-step, early enough for the run to outlive the outage), 20 s down, restarted on
  the same store and port: no rank_lost, hang or straggler, and telemetry continues;
  collector_restart_late (beyond the brief): the same at --fault-step, so that the run may
  end while the collector is down: where does its tail telemetry go, and is a run that
  ended unheard taken for a lost one; kill9_in_outage (beyond the brief): rank 2 killed
  while the collector is down: named after the restart (collector/watchdog.py says so)?
- clean_bursty: `--bursty-runs` clean runs while 4 busy processes per core run 15 s on,
  15 s off: no alert at all; false alerts per 10,000 steps.
Each scenario's line says what was expected, what came, the latency, the culprit named and
the false alerts (alerts not the expected one; resolve rows are not counted), with the
1-minute load average before it; the alerts' messages follow, indented. The headline is
the last line.

    python bench/external_faults.py | tee bench/results/external_faults.txt
    python bench/external_faults.py --only kill9,throttle25 --steps 300
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from trainvitals.demo import wait_healthy
from trainvitals.trainer.launch import torchrun_command

RANKS = 4
LOG_EVERY = 10
POLL_S = 0.5
LIVENESS = ("rank_lost", "hang")
BUSY_PER_CORE, BURST_S = 4, 15  # clean_bursty: busy processes per core, 15 s on, 15 s off
AFTER_RESTART_S = 45  # seconds the alerts are watched after a restarted collector is back
SCENARIOS = (
    "kill9",
    "sigstop",
    "node_loss",
    "throttle25",
    "throttle12",
    "throttle50",
    "freeze30",
    "quota10",
    "control_inject25",
    "collector_restart",
    "collector_restart_late",
    "kill9_in_outage",
    "clean_bursty",
)


def get(url: str, **params) -> list | dict | None:
    try:
        r = httpx.get(url, params=params, timeout=10)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def rank_pids(root: int) -> dict[int, int]:
    """rank -> pid of the descendants of `root` whose environment has RANK (torchrun may
    start each rank in a session of its own: follow the parents)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(stat[1])
    family, grew = {root}, True
    while grew:
        kids = {pid for pid, ppid in parents.items() if ppid in family} - family
        family |= kids
        grew = bool(kids)
    found = {}
    for pid in family - {root}:
        with contextlib.suppress(OSError):
            for var in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if var.startswith(b"RANK="):
                    found[int(var[5:])] = pid
    return found


def signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


class Collector:
    """`trainvitals collector` on 127.0.0.1:`port` over `store`, in its own session; it can
    be stopped and started again on the same store and port."""

    def __init__(self, store: Path, port: int, log: Path) -> None:
        self.store, self.port, self.log = store, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        argv = [sys.executable, "-m", "trainvitals", "collector", "--store", str(self.store)]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [*argv, "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_healthy(f"{self.url}/healthz", self.proc, timeout_s=120)

    def stop(self) -> None:
        """SIGTERM (uvicorn flushes and closes the store), SIGKILL after 60 s."""
        if self.proc is None:
            return
        signal_group(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


@dataclass
class Seen:
    alert: dict
    seen_s: float  # bench clock (time.time()) of the poll that first read it


@dataclass
class Run:
    """One 4-rank trainer run into the collector, and the alerts read from it so far."""

    collector: Collector
    name: str
    steps: int
    log: Path
    run_id: str = ""
    proc: subprocess.Popen | None = None
    seen: dict[tuple, Seen] = field(default_factory=dict)
    rc: int | None = None
    ranks: dict[int, int] = field(default_factory=dict)
    ended_s: float | None = None  # when the bench saw the trainer end
    extra: tuple[str, ...] = ()  # more trainer flags

    def __post_init__(self) -> None:
        self.run_id = f"ext-{self.name}-{int(time.time())}"
        train = ["--dp", str(RANKS), "--device", "cpu", "--steps", str(self.steps),
                 "--log-every", str(LOG_EVERY), "--collector", self.collector.url,
                 "--run-id", self.run_id, *self.extra]  # fmt: skip
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                torchrun_command(RANKS, train),
                stdout=log,
                stderr=subprocess.STDOUT,
                # The hooks spool what the collector cannot take now; a spool of this run's
                # own, not the user's (~/.cache), which other runs on this machine share.
                env={
                    **os.environ,
                    "OMP_NUM_THREADS": "1",
                    "TRAINVITALS_SPOOL_DIR": str(self.log.with_suffix(".spool")),
                },
                start_new_session=True,
            )

    @property
    def base(self) -> str:
        return f"{self.collector.url}/api/v1/runs/{self.run_id}"

    def rank_pids(self, timeout_s: float = 60) -> dict[int, int]:
        """rank -> pid of the trainer's descendants whose environment has RANK (torchrun
        starts each rank in a session of its own); remembered for `kill`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = rank_pids(self.proc.pid)
            if len(found) == RANKS:
                self.ranks = found
                return found
            time.sleep(0.5)
        raise RuntimeError(f"found the processes of ranks {sorted(found)} only")

    def last_step(self) -> int | None:
        runs = get(f"{self.collector.url}/api/v1/runs") or []
        return next((r["last_step"] for r in runs if r["run_id"] == self.run_id), None)

    def poll(self) -> None:
        """Read the run's alerts; note when each was first read."""
        for a in get(f"{self.base}/alerts") or []:
            key = (a["kind"], a["step"], a["severity"], a.get("rank"))
            self.seen.setdefault(key, Seen(a, time.time()))

    def alive(self) -> bool:
        if self.rc is None and self.proc.poll() is not None:
            self.rc, self.ended_s = self.proc.returncode, time.time()
        return self.rc is None

    def watch(self, seconds: float, until=None) -> None:
        """Poll the alerts for `seconds`, or until `until()` holds."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.poll()
            if until is not None and until():
                return
            time.sleep(POLL_S)

    def wait_step(self, step: int, timeout_s: float = 900) -> int:
        """Poll until the run logged `step` (or later); the step it logged."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll()
            last = self.last_step()
            if last is not None and last >= step:
                return last
            if not self.alive():
                raise RuntimeError(f"{self.run_id} ended (rc {self.rc}) before step {step}")
            time.sleep(POLL_S)
        raise RuntimeError(f"{self.run_id} did not reach step {step} in {timeout_s:.0f} s")

    def wait_end(self, timeout_s: float) -> None:
        self.watch(timeout_s, until=lambda: not self.alive())
        self.watch(5)  # the last heartbeats and rows, and what the analyzer made of them

    def kill(self) -> None:
        """SIGKILL the agent and every rank still there (a stopped rank dies too)."""
        if self.proc is None:
            return
        if self.alive() and not self.ranks:
            with contextlib.suppress(RuntimeError):
                self.rank_pids(timeout_s=1)
        self.kill_all()
        self.proc.wait(60)
        self.alive()

    def kill_all(self) -> None:
        """SIGKILL the agent's session and each rank's, at once."""
        for pid in (self.proc.pid, *self.ranks.values()):
            signal_group(pid, signal.SIGKILL)

    def raised(self) -> list[Seen]:
        """Alerts raised (resolve rows left out), in the order they were read."""
        rows = [s for s in self.seen.values() if s.alert["severity"] != "resolved"]
        return sorted(rows, key=lambda s: (s.seen_s, s.alert["step"]))

    def resolved(self, kind: str) -> list[Seen]:
        rows = self.seen.values()
        return [s for s in rows if s.alert["kind"] == kind and s.alert["severity"] == "resolved"]

    def rank_rows(self) -> list[dict]:
        """One row per (logged step, rank): step, compute, wait and collective times."""
        metrics = ("step_time_s", "compute_time_s", "wait_time_s", *COLLECTIVE_TIMES)
        grid = get(f"{self.base}/ranks/grid", metric=list(metrics), agg="mean", max_steps=10_000)
        if not grid:
            return []
        cols = {k: v for k, v in grid.items() if isinstance(v, list)}
        return [dict(zip(cols, values, strict=True)) for values in zip(*cols.values(), strict=True)]


@dataclass
class Outcome:
    kind: str
    expected: str
    came: str = "nothing"
    latency: str = "-"
    culprit: str = "-"
    false_alerts: int = 0
    ok: bool = False
    load: float = 0.0
    notes: list[str] = field(default_factory=list)
    alerts: list[str] = field(default_factory=list)

    def line(self) -> str:
        verdict = "as expected" if self.ok else "NOT as expected"
        return (
            f"{self.kind}: expected {self.expected} | came: {self.came} | latency "
            f"{self.latency} | culprit named: {self.culprit} | false alerts "
            f"{self.false_alerts} | {verdict} (1-min load {self.load:.1f} before)"
        )


def describe(run: Run, fault_s: float | None, fault_step: int | None) -> list[str]:
    """Every alert row of the run, in the order read, times relative to the fault."""
    out = []
    for s in sorted(run.seen.values(), key=lambda s: (s.seen_s, s.alert["step"])):
        a = s.alert
        when = f"read {s.seen_s - fault_s:+.1f} s" if fault_s else "read"
        onset = f" onset {a['start_step']}" if a.get("start_step") is not None else ""
        steps = f" ({a['step'] - fault_step:+d} steps)" if fault_step is not None else ""
        out.append(
            f"{when}, step {a['step']}{steps}{onset}: {a['kind']} {a['severity']} rank "
            f"{a.get('rank')}: {a['message']}"
        )
    return out


def named(raised: list[Seen]) -> str:
    names = [f"{s.alert['kind']} (rank {s.alert.get('rank')})" for s in raised]
    return ", ".join(names) or "no alert"


def fault_point(run: Run) -> tuple[float, int | None]:
    return time.time(), run.last_step()


def liveness_outcome(
    o: Outcome, run: Run, fault_s: float, kinds: tuple[str, ...], rank: int | None, limit_s: float
) -> Seen | None:
    """Fill `o` from the first alert of `kinds` raised after the fault; count the others."""
    raised = run.raised()
    first = next(
        (s for s in raised if s.alert["kind"] in kinds and s.seen_s >= fault_s - POLL_S), None
    )
    o.false_alerts = sum(1 for s in raised if s is not first and s.alert["kind"] not in kinds)
    before = [s for s in raised if s.seen_s < fault_s - POLL_S]
    if before:
        o.notes.append(f"{len(before)} alert(s) read before the fault")
    if first is None:
        o.came = f"no {' or '.join(kinds)}"
        return None
    a = first.alert
    latency = first.seen_s - fault_s
    o.came = f"{a['kind']} ({a['severity']})"
    o.latency = f"{latency:.1f} s (the alert's own time {a['time_unix_s'] - fault_s:+.1f} s)"
    o.culprit = "none" if a.get("rank") is None else f"rank {a['rank']}"
    wrong_first = any(
        s.alert.get("rank") not in (None, rank) and s.seen_s <= first.seen_s
        for s in raised
        if s is not first
    )
    o.ok = latency <= limit_s and (rank is None or a.get("rank") == rank) and not wrong_first
    return first


def kill9(collector: Collector, args, tmp: Path, o: Outcome) -> None:
    rank = 2
    run = Run(collector, "kill9", args.steps, tmp / "kill9.log")
    try:
        run.wait_step(args.fault_step)
        pid = run.rank_pids()[rank]
        signal_pid(pid, signal.SIGKILL)
        fault_s, fault_step = fault_point(run)
        o.notes.append(f"SIGKILL of rank {rank} (pid {pid}) at logged step {fault_step}")
        run.watch(45)
    finally:
        run.kill()
    liveness_outcome(o, run, fault_s, ("rank_lost",), rank, 30)
    o.alerts = describe(run, fault_s, fault_step)


def sigstop(collector: Collector, args, tmp: Path, o: Outcome) -> None:
    rank, stopped_s = 1, 60
    run = Run(collector, "sigstop", args.steps, tmp / "sigstop.log")
    try:
        run.wait_step(args.fault_step)
        pid = run.rank_pids()[rank]
        signal_pid(pid, signal.SIGSTOP)
        fault_s, fault_step = fault_point(run)
        try:
            run.watch(stopped_s)
        finally:
            signal_pid(pid, signal.SIGCONT)
        cont_s = time.time()
        o.notes.append(
            f"SIGSTOP of rank {rank} (pid {pid}) at logged step {fault_step}, SIGCONT "
            f"{cont_s - fault_s:.0f} s later at logged step {run.last_step()}"
        )
        run.wait_end(600)
    finally:
        run.kill()
    first = liveness_outcome(o, run, fault_s, LIVENESS, rank, 60)
    last = run.last_step()
    completed = run.rc == 0 and last is not None and last >= args.steps - LOG_EVERY
    o.notes.append(f"trainer exit code {run.rc}, last logged step {last} of {args.steps}")
    if first is not None:
        kind = first.alert["kind"]
        after = [s for s in run.resolved(kind) if s.seen_s >= cont_s - POLL_S]
        o.came += ", resolved" if after else ", never resolved"
        if after:
            o.notes.append(f"{kind} resolved {after[0].seen_s - cont_s:.1f} s after SIGCONT")
        o.ok = o.ok and bool(after)
    o.ok = o.ok and completed
    o.alerts = describe(run, fault_s, fault_step)


def node_loss(collector: Collector, args, tmp: Path, o: Outcome) -> None:
    run = Run(collector, "node_loss", args.steps, tmp / "node_loss.log")
    try:
        run.wait_step(args.fault_step)
        pids = run.rank_pids()
        run.kill_all()  # the agent and the 4 ranks at once
        fault_s, fault_step = fault_point(run)
        o.notes.append(
            f"SIGKILL of the torchrun agent and ranks {sorted(pids)} at logged step {fault_step}"
        )
        run.watch(45)
    finally:
        run.kill()
    liveness_outcome(o, run, fault_s, ("rank_lost",), None, 30)
    o.alerts = describe(run, fault_s, fault_step)


def duty_cycle(pid: int, stopped_ms: int, stop: threading.Event) -> None:
    """SIGSTOP for `stopped_ms` of every 100 ms until `stop` is set; SIGCONT at the end."""
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_ms / 1000)
            os.kill(pid, signal.SIGCONT)
            time.sleep((100 - stopped_ms) / 1000)
    except ProcessLookupError:
        pass
    finally:
        signal_pid(pid, signal.SIGCONT)


Fault = Callable[[int, threading.Event], None]  # (pid, until): applied until `until` is set


def sigstops(ms: int) -> Fault:
    """SIGSTOP / SIGCONT: stopped `ms` of every 100 ms."""
    return lambda pid, until: duty_cycle(pid, ms, until)


CGROUP_V1 = Path("/sys/fs/cgroup")


def frozen(ms: int) -> Fault:
    """The cgroup (v1) freezer, as `docker pause` uses it: frozen `ms` of every 100 ms."""

    def fault(pid: int, until: threading.Event) -> None:
        group = CGROUP_V1 / "freezer" / f"tv-bench-{pid}"
        group.mkdir()
        try:
            (group / "cgroup.procs").write_text(str(pid))
            while not until.is_set():
                (group / "freezer.state").write_text("FROZEN")
                time.sleep(ms / 1000)
                (group / "freezer.state").write_text("THAWED")
                time.sleep((100 - ms) / 1000)
        finally:
            (group / "freezer.state").write_text("THAWED")
            _leave(group, CGROUP_V1 / "freezer")

    return fault


def cpu_quota(percent: int) -> Fault:
    """A CPU quota (cgroup v1 CFS bandwidth, as a container's CPU limit): `percent` of one
    CPU per 100 ms period."""

    def fault(pid: int, until: threading.Event) -> None:
        group = CGROUP_V1 / "cpu" / f"tv-bench-{pid}"
        group.mkdir()
        try:
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text(str(percent * 1000))
            (group / "cgroup.procs").write_text(str(pid))
            until.wait()
        finally:
            _leave(group, CGROUP_V1 / "cpu")

    return fault


def _leave(group: Path, root: Path) -> None:
    """Move the group's processes back to the root group and remove it."""
    with contextlib.suppress(OSError):
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(pid)
        group.rmdir()


def cgroup_writable(controller: str) -> bool:
    probe = CGROUP_V1 / controller / "tv-bench-probe"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError:
        return False
    return True


# FSDP's collectives, host-timed on gloo, waiting for the slowest peer included
# (hooks/comms.py): the rank the others wait for should spend the least time in them.
COLLECTIVE_TIMES = ("all_gather_time_s", "reduce_scatter_time_s")


def slowdown(rows: list[dict], rank: int, start: int, end: int) -> list[str]:
    """Step, compute, wait and collective times of the faulty rank and the others, before
    the fault (the 100 steps before it, the first 30 steps of the run left out) and
    during."""
    before = (max(30, start - 100), start)
    windows = {"before": before, "during": (start + LOG_EVERY, end)}
    out, means = [], {}
    for label, (lo, hi) in windows.items():
        for who, pick in ((f"rank {rank}", lambda r: r == rank), ("others", lambda r: r != rank)):
            sel = [r for r in rows if lo <= r["step"] < hi and pick(r["rank"])]
            vals = {}
            for m in ("step_time_s", "compute_time_s", "wait_time_s", *COLLECTIVE_TIMES):
                xs = [r[f"mean_{m}"] for r in sel if r.get(f"mean_{m}") is not None]
                vals[m] = statistics.fmean(xs) if xs else float("nan")
            means[label, who] = vals
            collectives = sum(vals[m] for m in COLLECTIVE_TIMES)
            out.append(
                f"{label} (steps {lo}-{hi - 1}) {who}: step {vals['step_time_s'] * 1e3:.0f} ms, "
                f"compute (CPU) {vals['compute_time_s'] * 1e3:.0f} ms, wait "
                f"{vals['wait_time_s'] * 1e3:.0f} ms, in collectives {collectives * 1e3:.0f} ms"
            )
    job = means["during", "others"]["step_time_s"] / means["before", "others"]["step_time_s"]
    own_b = means["before", f"rank {rank}"]
    own_d = means["during", f"rank {rank}"]
    own = (own_d["step_time_s"] - own_d["wait_time_s"]) / (
        own_b["step_time_s"] - own_b["wait_time_s"]
    )
    cpu = own_d["compute_time_s"] / own_b["compute_time_s"]
    out.insert(
        0,
        f"slowdown: job step time x{job:.2f}; rank {rank}'s step minus wait x{own:.2f}; "
        f"its compute (CPU) time x{cpu:.2f}",
    )
    return out


def throttle(name: str, fault: Fault, what: str, cgroup: str = ""):
    """Rank 3 slowed by `fault` (`what` it does) for 150 steps; `cgroup`: the cgroup v1
    controller it needs (skipped where it is not writable)."""

    def scenario(collector: Collector, args, tmp: Path, o: Outcome) -> None:
        if cgroup and not cgroup_writable(cgroup):
            o.came = f"skipped: cgroup v1 {cgroup} not writable here (needs root)"
            return
        rank, length = 3, 150
        run = Run(collector, name, args.steps, tmp / f"{name}.log")
        stop = threading.Event()
        thread = None
        try:
            run.wait_step(args.fault_step)
            pid = run.rank_pids()[rank]
            thread = threading.Thread(target=fault, args=(pid, stop))
            thread.start()
            fault_s, start = fault_point(run)
            try:
                end = run.wait_step(start + length)
            finally:
                stop.set()
                thread.join()
            end_s = time.time()
            o.notes.append(
                f"rank {rank} (pid {pid}) {what} from logged step {start} to logged step "
                f"{end} ({end_s - fault_s:.0f} s)"
            )
            run.wait_end(900)
        finally:
            stop.set()
            if thread is not None:
                thread.join()
            run.kill()
        raised = run.raised()
        hits = [
            s
            for s in raised
            if s.alert["kind"] == "straggler"
            and s.alert.get("rank") == rank
            and s.alert["step"] >= start
        ]
        first = hits[0] if hits else None
        o.false_alerts = sum(1 for s in raised if s is not first)
        if first is None:
            o.came = "no straggler naming rank 3"
        else:
            a = first.alert
            o.came = f"straggler ({a['severity']})"
            o.culprit = f"rank {a['rank']}"
            onset = f", onset step {a['start_step']}" if a.get("start_step") is not None else ""
            o.latency = (
                f"{a['step'] - start} steps (alert step {a['step']}{onset}; read "
                f"{first.seen_s - fault_s:.0f} s after the throttle began)"
            )
            res = [s for s in run.resolved("straggler") if s.alert["step"] > a["step"]]
            o.came += ", resolved" if res else ", never resolved"
            if res:
                step = res[0].alert["step"]
                o.notes.append(f"resolved at step {step} ({step - end:+d} steps from its end)")
            o.ok = bool(res) and o.false_alerts == 0 and a["step"] <= end
        o.notes += slowdown(run.rank_rows(), rank, start, end)
        o.notes.append(f"trainer exit code {run.rc}, last logged step {run.last_step()}")
        o.alerts = describe(run, fault_s, start)

    return scenario


def control_inject25(collector: Collector, args, tmp: Path, o: Outcome) -> None:
    """The positive control: the trainer's own straggler fault (busy work, 25% of a step's
    compute) on rank 3 from step --fault-step, on the same layout and log interval."""
    rank, start = 3, args.fault_step
    inject = ("--inject", f"straggler:rank={rank},step={start},slowdown=0.25")
    run = Run(collector, "control_inject25", args.steps, tmp / "control_inject25.log", extra=inject)
    try:
        run.wait_end(900)
    finally:
        run.kill()
    raised = run.raised()
    hits = [s for s in raised if s.alert["kind"] == "straggler" and s.alert.get("rank") == rank]
    first = hits[0] if hits else None
    o.false_alerts = sum(1 for s in raised if s is not first)
    if first is not None:
        a = first.alert
        o.came, o.culprit = f"straggler ({a['severity']})", f"rank {a['rank']}"
        o.latency = f"{a['step'] - start} steps (alert step {a['step']}, onset {a['start_step']})"
        o.ok = o.false_alerts == 0
    else:
        o.came = "no straggler naming rank 3"
    o.notes += slowdown(run.rank_rows(), rank, start, args.steps)
    o.notes.append(f"trainer exit code {run.rc}, last logged step {run.last_step()}")
    o.alerts = describe(run, None, start)


def collector_restart(late: bool):
    """The collector down for 20 s from the logged step --restart-step (the run outlives the
    outage), or, `late`, from --fault-step (the run may end while the collector is down)."""

    def scenario(collector: Collector, args, tmp: Path, o: Outcome) -> None:
        down_s = 20
        name = "collector_restart_late" if late else "collector_restart"
        run = Run(collector, name, args.steps, tmp / f"{name}.log")
        try:
            run.wait_step(args.fault_step if late else args.restart_step)
            fault_s, fault_step = fault_point(run)
            collector.stop()
            stopped_s = time.time()
            while time.time() < stopped_s + down_s:
                run.alive()  # notes when the trainer ends
                time.sleep(POLL_S)
            restart_s = time.time()
            collector.start()
            back_s = time.time()
            o.notes.append(
                f"SIGTERM at logged step {fault_step}, collector stopped in "
                f"{stopped_s - fault_s:.1f} s, down {restart_s - stopped_s:.0f} s, healthy "
                f"again {back_s - restart_s:.1f} s after the restart; the store's last step "
                f"then: {run.last_step()}"
            )
            run.wait_end(900)
            o.notes.append(f"the trainer ended {run.ended_s - back_s:+.0f} s from the return")
            # A run restored at the restart gets silence_s (10 s) from the return before a
            # silent rank is lost: watch well past that before calling it quiet.
            run.watch(back_s + AFTER_RESTART_S - time.time())
        finally:
            run.kill()
        o.notes += [f"trainer log: {line}" for line in log_lines(run.log, ("spool", "export"))]
        spooled = sorted(p.name for p in run.log.with_suffix(".spool").glob("rank*/*"))
        o.notes.append(f"left in the run's spool: {len(spooled)} files {spooled[:4]}")
        logged = sorted({r["step"] for r in run.rank_rows()})
        gaps = [(a, b) for a, b in itertools.pairwise(logged) if b - a > LOG_EVERY]
        o.notes.append(
            f"trainer exit code {run.rc}; logged steps stored {len(logged)} "
            f"(last {logged[-1] if logged else None}); gaps in the logged steps: {gaps or 'none'}"
        )
        raised = run.raised()
        o.false_alerts = len(raised)
        o.came = named(raised)
        last = logged[-1] if logged else -1
        # Late: a run that ends while the collector is down leaves its tail in its spool,
        # for the next run or `trainvitals import` (hooks/exporter.py): as documented.
        delivered = last >= args.steps - LOG_EVERY or (late and bool(spooled))
        o.ok = not raised and run.rc == 0 and delivered
        o.alerts = describe(run, fault_s, fault_step)

    return scenario


def kill9_in_outage(collector: Collector, args, tmp: Path, o: Outcome) -> None:
    """Rank 2 killed while the collector is down (the watchdog's restore says such a rank
    is still named)."""
    rank, down_s = 2, 20
    run = Run(collector, "kill9_in_outage", args.steps, tmp / "kill9_in_outage.log")
    try:
        run.wait_step(args.fault_step)
        pid = run.rank_pids()[rank]
        collector.stop()
        signal_pid(pid, signal.SIGKILL)
        fault_s = time.time()
        time.sleep(down_s)
        collector.start()
        back_s = time.time()
        o.notes.append(
            f"collector stopped at logged step {args.fault_step}+, then SIGKILL of rank {rank} "
            f"(pid {pid}); collector healthy again {back_s - fault_s:.0f} s after the kill"
        )
        run.watch(AFTER_RESTART_S)
    finally:
        run.kill()
    o.notes.append(f"trainer exit code {run.rc}")
    # The 30 s target counts from the collector's return: it heard nothing before.
    liveness_outcome(o, run, back_s, ("rank_lost",), rank, 30)
    o.latency += " from the collector's return"
    o.alerts = describe(run, fault_s, None)


def log_lines(path: Path, words: tuple[str, ...], most: int = 3) -> list[str]:
    """The first `most` lines of a log that hold one of `words` (evidence), and a count."""
    lines = [
        line.strip()
        for line in path.read_text(errors="replace").splitlines()
        if any(w in line for w in words)
    ]
    more = [f"... and {len(lines) - most} more such lines"] if len(lines) > most else []
    return lines[:most] + more


def bursty_run(collector: Collector, args, tmp: Path, i: int) -> tuple[Run, int]:
    """One clean run while BUSY_PER_CORE busy processes per core come and go; its bursts."""
    spin = [sys.executable, "-c", "while True: pass"]
    run = Run(collector, f"clean_bursty{i}", args.steps, tmp / f"clean_bursty{i}.log")
    busy: list[subprocess.Popen] = []
    bursts = 0
    try:
        while run.alive():
            bursts += 1
            busy = [
                subprocess.Popen(spin, start_new_session=True)
                for _ in range(BUSY_PER_CORE * (os.cpu_count() or 1))
            ]
            run.watch(BURST_S, until=lambda: not run.alive())
            for p in busy:
                signal_group(p.pid, signal.SIGKILL)
            for p in busy:
                p.wait()
            busy = []
            run.watch(BURST_S, until=lambda: not run.alive())
        run.watch(5)
    finally:
        for p in busy:
            signal_group(p.pid, signal.SIGKILL)
            p.wait()
        run.kill()
    return run, bursts


def clean_bursty(collector: Collector, args, tmp: Path, o: Outcome) -> None:
    raised, steps = [], 0
    for i in range(args.bursty_runs):
        run, bursts = bursty_run(collector, args, tmp, i)
        last = run.last_step() or 0
        steps += last + 1
        raised += run.raised()
        o.ok = (i == 0 or o.ok) and not run.raised() and run.rc == 0
        o.notes.append(
            f"run {i}: {bursts} bursts of {BUSY_PER_CORE * (os.cpu_count() or 1)} busy "
            f"processes ({BURST_S} s on, {BURST_S} s off); trainer exit code {run.rc}, last "
            f"logged step {last}, {len(run.raised())} alerts"
        )
        o.alerts += describe(run, None, None)
    o.false_alerts = len(raised)
    o.came = named(raised)
    o.notes.append(
        f"{len(raised) / max(1, steps) * 10_000:.0f} false alerts per 10,000 steps "
        f"({len(raised)} in {steps} steps)"
    )


EXPECTED = {
    "kill9": "rank_lost naming rank 2 within 30 s, nobody else first",
    "sigstop": "rank_lost or hang naming rank 1 within 60 s, resolved after SIGCONT, run completes",
    "node_loss": "rank_lost within 30 s",
    "throttle25": "straggler naming rank 3, resolved after, nothing else",
    "throttle12": "straggler naming rank 3, resolved after, nothing else",
    "throttle50": "straggler naming rank 3, resolved after, nothing else",
    "freeze30": "straggler naming rank 3, resolved after, nothing else",
    "quota10": "straggler naming rank 3, resolved after, nothing else",
    "control_inject25": "straggler naming rank 3 (the trainer's own fault; it lasts to the end)",
    "collector_restart": "no rank_lost/hang/straggler, telemetry continues",
    "collector_restart_late": "no rank_lost/hang/straggler; its tail stored or spooled",
    "kill9_in_outage": "rank_lost naming rank 2 within 30 s of the collector's return",
    "clean_bursty": "no alert",
}
RUNNERS = {
    "kill9": kill9,
    "sigstop": sigstop,
    "node_loss": node_loss,
    "throttle25": throttle("throttle25", sigstops(25), "stopped 25 ms of every 100 ms"),
    "throttle12": throttle("throttle12", sigstops(12), "stopped 12 ms of every 100 ms"),
    "throttle50": throttle("throttle50", sigstops(50), "stopped 50 ms of every 100 ms"),
    "freeze30": throttle(
        "freeze30", frozen(30), "frozen 30 ms of every 100 ms (cgroup freezer)", "freezer"
    ),
    "quota10": throttle("quota10", cpu_quota(10), "held to 10% of a CPU (CFS quota)", "cpu"),
    "control_inject25": control_inject25,
    "collector_restart": collector_restart(late=False),
    "collector_restart_late": collector_restart(late=True),
    "kill9_in_outage": kill9_in_outage,
    "clean_bursty": clean_bursty,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help=f"comma-separated scenarios among {','.join(SCENARIOS)}")
    p.add_argument("--steps", type=int, default=400, help="training steps of each run")
    p.add_argument("--fault-step", type=int, default=100, help="logged step of the fault")
    p.add_argument(
        "--restart-step",
        type=int,
        default=30,
        help="logged step of the collector's restart (early: the run must outlive the outage)",
    )
    p.add_argument("--bursty-runs", type=int, default=3, help="clean_bursty's runs")
    p.add_argument("--port", type=int, default=42100, help="the collector's port")
    p.add_argument("--logs", help="keep the trainer and collector logs in this folder")
    args = p.parse_args()
    chosen = args.only.split(",") if args.only else list(SCENARIOS)
    unknown = [c for c in chosen if c not in RUNNERS]
    if unknown:
        p.error(f"unknown scenarios {unknown}; choose among {list(SCENARIOS)}")
    print(
        f"external faults on {RANKS} CPU ranks (gloo, dp {RANKS}), {args.steps} steps, "
        f"log every {LOG_EVERY}, faults at logged step {args.fault_step}; {os.cpu_count()} cores",
        flush=True,
    )
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(args.logs or tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        collector = Collector(tmp / "external.duckdb", args.port, tmp / "collector.log")
        try:
            for kind in chosen:
                o = Outcome(kind, EXPECTED[kind], load=os.getloadavg()[0])
                try:
                    RUNNERS[kind](collector, args, tmp, o)
                except Exception as e:  # one broken scenario must not stop the rest
                    o.came = f"bench error: {type(e).__name__}: {e}"
                    if collector.proc is None:
                        collector.start()
                outcomes.append(o)
                print(o.line(), flush=True)
                for note in o.notes:
                    print(f"    {note}", flush=True)
                for text in o.alerts:
                    print(f"    alert {text}", flush=True)
        finally:
            collector.stop()
    passed = [o.kind for o in outcomes if o.ok]
    failed = [o.kind for o in outcomes if not o.ok]
    print(
        f"external faults on {RANKS} CPU ranks: {len(passed)}/{len(outcomes)} as expected"
        f" ({', '.join(passed) or 'none'}); not as expected: {', '.join(failed) or 'none'}"
    )


if __name__ == "__main__":
    main()
