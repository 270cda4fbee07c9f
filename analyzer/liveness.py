"""Liveness in wall time: a rank that stops sending heartbeats (`rank_lost`), and a job whose
heartbeats go on while no step completes (`hang`).

A crash or a hang sends no more telemetry, so a detector that runs when data arrives never
sees one (DESIGN invariant 10). Each rank's hooks send a heartbeat every few seconds from a
background thread (hooks/heartbeat.py); the collector stamps each with its receive time and
a thread of the collector (collector/watchdog.py) moves this watchdog's clock on.

    watchdog = Watchdog()
    watchdog.observe(run_id, heartbeats_table)  # stamped with received_unix_s
    alerts = watchdog.advance(now_unix_s)        # every deadline passed before now

Time base: the collector's receive times only. `advance(now)` takes the heartbeats received
up to `now` in time order and fires each deadline that passed before the next one: a rank's
is its last heartbeat + `silence_s`, the job's is its last completed step + the hang
threshold. An alert's time is its deadline, not the moment a tick noticed it, so replaying
the stored heartbeats with a simulated clock (analyzer/replay.py) raises exactly the live
alerts, whatever the live ticks were.

Who is named:
- rank_lost: the first rank to go silent. When torchrun tears the job down after a crash the
  others go silent (or say goodbye with phase "exited") a moment later; they join the open
  episode instead of raising alerts of their own.
- hang: the ranks the others wait for: those that have not begun the step the others are in,
  else those not waiting in a collective while the others are; else the whole job paused,
  and in which phase. When those ranks are all in a pause the loop declared (a checkpoint
  save, an evaluation: `monitor.pause`), the threshold is that phase's: `pause_intervals`
  times the longest pause of that phase the run came back from (at least `pause_floor_s`),
  and `pause_s` before the run has come back from one.
Both resolve when a step completes again. A run that ends (a heartbeat with phase "ended",
which Monitor.close sends, or a `run_end` event) never alarms. Nor does a job the supervisor
stops (an `action:stop` event, before it stops the ranks): the ranks heard before a run's
end, and those that say goodbye after it, end with it, so a relaunch on fewer nodes does not
find the fenced node's ranks lost.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainvitals.schema import PAUSES

from .alerts import RESOLVED, Alert
from .runinfo import rank_on

RANK_LOST, HANG = "rank_lost", "hang"
RUN_END = "the run reported its end"
STOPPED = "the supervisor stopped the job"
# The event the supervisor sends before it stops a job (supervisor/agent.py): the ranks'
# silence that follows is its own doing.
STOP_EVENT = "action:stop"


@dataclass(frozen=True)
class LivenessSettings:
    """Thresholds of the liveness watchdog (section "liveness"). Seconds of the collector's
    clock, between heartbeat receipts."""

    # A rank silent this long is lost. Five of the hooks' 2 s heartbeat intervals: a busy
    # collector or network delays a few, not five in a row; a crash is named within
    # silence_s plus the collector's lag (collector/watchdog.py), well inside 30 s.
    silence_s: float = 10.0
    # No step completed for this many typical step times (and at least hang_floor_s): a
    # hang. Ten: a step 10x its usual length is a pause, not noise.
    hang_intervals: float = 10.0
    # The least time without a completed step that counts as a hang, in seconds: shorter
    # pauses (a checkpoint save, an evaluation, a garbage collection) are normal. 30 s keeps
    # a hang named inside the 60 s target with the heartbeat and lag delays.
    hang_floor_s: float = 30.0
    # How long a pause the training loop declared (`monitor.pause("checkpoint")`, "eval")
    # may last before it is a hang, when the ranks the job waits for are all in one: a
    # large model's synchronous save or an evaluation takes minutes, not 10 steps.
    pause_s: float = 1800.0
    # ... and once the run has come back from a pause of that phase, this many times the
    # longest such (at least pause_floor_s, at most pause_s): a job whose saves take 2 min
    # is not left hung in one for 30 min. A run's saves (or evaluations) repeat the same
    # work; an evaluation far longer than the earlier ones (a rare full benchmark after
    # quick validation losses) is called a hang once, and the alert says why.
    pause_intervals: float = 3.0
    pause_floor_s: float = 300.0
    # Before the typical step time is known (start-up: compilation, the first collectives,
    # a checkpoint load), a hang is this long without a completed step.
    first_step_s: float = 600.0
    # Progress observations (a heartbeat showing a newer finished step) needed before the
    # typical step time is trusted, and how many recent ones its median covers.
    min_history: int = 5
    window: int = 50
    # ... or fewer (two at least), once they have shown this many steps completed: a fast
    # job whose ranks finish 50 steps between two heartbeats knows its step time after two
    # of them. A 2-rank CPU run of the reference trainer that hung at step 150, 6 s after
    # its first step, had three: its hang waited first_step_s (600 s), not 30 s.
    min_history_steps: int = 20
    # A run with every rank silent or ended this long is forgotten (bounded memory).
    forget_s: float = 3600.0

    def __post_init__(self) -> None:
        positive = (
            "silence_s", "hang_intervals", "hang_floor_s", "pause_s", "pause_intervals",
            "pause_floor_s", "first_step_s", "forget_s",
        )  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"liveness.{name} must be a finite number > 0, got {value!r}")
        for name in ("min_history", "window", "min_history_steps"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"liveness.{name} must be a whole number >= 1, got {value!r}")
        if self.min_history > self.window:
            raise ValueError(
                f"liveness.min_history ({self.min_history}) must be <= liveness.window "
                f"({self.window})"
            )


@dataclass
class _Rank:
    host: str
    heard_s: float  # receive time of its latest heartbeat
    started: int  # last step begun
    finished: int  # last step finished
    phase: str
    gone: bool = False  # silent past silence_s: lost (or ended with its run)
    restored: bool = False  # known from the store at a collector's restart, not heard since


@dataclass
class _Run:
    first_heard_s: float
    ranks: dict[int, _Rank] = field(default_factory=dict)
    # (deadline, rank, heard_s): a rank's silence deadline; stale once it is heard again.
    deadlines: list[tuple[float, int, float]] = field(default_factory=list)
    done_s: float = -math.inf  # deadlines before this have fired
    progress_step: int = -1  # last step the job completed, as its heartbeats said
    progress_s: float = math.nan  # when that was first heard (NaN: no progress yet)
    # When a rank was last heard leaving a declared pause: the hang clock starts again there.
    pause_left_s: float = -math.inf
    # When the current pause of each declared phase was first heard, and the longest pause
    # of each phase the run came back from without a hang open (seconds of heartbeats).
    pause_began_s: dict[str, float] = field(default_factory=dict)
    longest_pause_s: dict[str, float] = field(default_factory=dict)
    per_step_s: deque = field(default_factory=deque)  # recent seconds per completed step
    observed_steps: int = 0  # steps completed over the progress observations made
    ended: bool = False
    stopped: bool = False  # ended by the supervisor: only a new process resumes it
    # A new process (a relaunch, a restart) has not completed a step yet: its start-up
    # (checkpoint load, compilation) is judged like the run's first step (first_step_s).
    starting: bool = False
    lost: Alert | None = None  # the open rank_lost episode
    hang: Alert | None = None  # the open hang episode
    # Step of each kind's last alert row: the store keeps one row per kind and step.
    row_steps: dict[str, int] = field(default_factory=dict)
    # (received, arrival order, a heartbeat's fields or why the run ended): not processed yet
    pending: list[tuple[float, int, tuple | str]] = field(default_factory=list)


@dataclass
class Watchdog:
    """Liveness of every run whose heartbeats it is given (see the module docstring)."""

    settings: LivenessSettings = field(default_factory=LivenessSettings)
    _runs: dict[str, _Run] = field(default_factory=dict, repr=False)
    _order: int = 0  # arrival order: ties in receive time keep it
    late: int = 0  # heartbeats received before the time already judged (see advance)

    def observe(self, run_id: str, heartbeats: Any) -> None:
        """Take heartbeats (a pyarrow table of schema.HEARTBEATS, with received_unix_s)."""
        cols = heartbeats.select(
            ["rank", "host", "step_started", "step_finished", "phase", "received_unix_s"]
        ).to_pydict()
        rows = zip(*cols.values(), strict=True)
        run = self._run(run_id, min(cols["received_unix_s"], default=0.0))
        for rank, host, started, finished, phase, received_s in rows:
            self._order += 1
            item = (rank, host, started, finished, phase)
            run.pending.append((received_s, self._order, item))

    def end_run(self, run_id: str, time_unix_s: float, why: str = RUN_END) -> None:
        """The run ended at `time_unix_s`: it reported a clean end (a `run_end` event), or
        the supervisor stopped it (`why` STOPPED: an `action:stop` event; it may relaunch
        the job, which resumes the watch)."""
        if run_id in self._runs:
            self._order += 1
            self._runs[run_id].pending.append((time_unix_s, self._order, why))

    def restore(
        self,
        run_id: str,
        heartbeats: Any,
        now_s: float,
        last_alerts: Sequence[Alert] = (),
        pause_lengths_s: Mapping[str, float] | None = None,
    ) -> None:
        """Rebuild a run's state after a restart of the collector at `now_s`.

        `heartbeats`: stored ones received before the restart (schema.HEARTBEATS with
        received_unix_s): at least each rank's latest, and the first receipt of each of the
        last `window` completed steps, from which the typical step time is learned again.
        `last_alerts`: the last stored rank_lost and hang rows of the run: those not
        `resolved` are open episodes, and a new row of their kind comes after their step.
        `pause_lengths_s`: per declared phase, the longest pause of it the run came back
        from, from the store's `pause:<phase>` events (the heartbeats kept do not tell).
        No deadline before `now_s` fires: the collector heard nothing while it was down, so
        that silence is nobody's. A rank silent for `silence_s` before the collector's last
        receipt went silent while it listened and stays lost; every other rank counts as
        heard at `now_s`, and the hang clock starts again there (a hang that began before
        the restart is named a full threshold after it). Replaying the store judges the
        downtime as silence instead (analyzer/replay.py knows nothing of the restart).
        """
        cols = heartbeats.select(
            ["received_unix_s", "rank", "host", "step_started", "step_finished", "phase"]
        ).to_pydict()
        rows = sorted(zip(*cols.values(), strict=True), key=lambda row: (row[0], row[1]))
        if not rows:
            return
        run = self._runs[run_id] = self._fresh(rows[0][0], [])
        for received_s, *item in rows:
            self._heard(run_id, run, received_s, *item)  # deadlines are judged below
        # Not every heartbeat is kept for a restart: when a pause began is not known (the
        # one in progress, if any, teaches nothing), and how long the earlier ones lasted
        # comes from their events.
        run.pause_began_s.clear()
        run.longest_pause_s = {
            phase: length_s
            for phase, length_s in (pause_lengths_s or {}).items()
            if phase in PAUSES and math.isfinite(length_s) and length_s > 0
        }
        last_s = rows[-1][0]
        run.deadlines.clear()
        for rank, r in run.ranks.items():
            if r.heard_s < last_s - self.settings.silence_s:
                r.gone = True
            elif not r.gone:
                r.restored = True
                heapq.heappush(run.deadlines, (now_s + self.settings.silence_s, rank, r.heard_s))
        if not math.isnan(run.progress_s):
            run.progress_s = max(run.progress_s, now_s)
        for alert in last_alerts:
            run.row_steps[alert.kind] = alert.step
            if alert.severity == RESOLVED:
                continue
            if alert.kind == RANK_LOST:
                run.lost = alert
            elif alert.kind == HANG:
                run.hang = alert
        run.done_s = now_s

    def declared_pauses(self) -> dict[str, tuple[str, ...]]:
        """Runs whose job is in a declared pause as of the heartbeats judged, and which
        phase(s) (see _declared_pause). O(ranks): for a scrape, not for every heartbeat."""
        out = {}
        for run_id, run in self._runs.items():
            if not run.ended and (paused := _declared_pause(run)):
                out[run_id] = paused
        return out

    def open_runs(self) -> list[str]:
        """Runs that have not ended."""
        return [run_id for run_id, run in self._runs.items() if not run.ended]

    def advance(self, now_s: float) -> list[Alert]:
        """Process what was received up to `now_s` and fire every deadline before it."""
        alerts: list[Alert] = []
        for run_id in list(self._runs):
            run = self._runs[run_id]
            run.pending.sort()
            due = [p for p in run.pending if p[0] <= now_s]
            run.pending = run.pending[len(due) :]
            for received_s, _, item in due:
                if received_s < run.done_s:
                    self.late += 1  # judged already without it; taken as of now
                    received_s = run.done_s
                alerts += self._fire(run_id, run, received_s)
                if self._forgettable(run, received_s):  # back after forget_s: a fresh start
                    run = self._runs[run_id] = self._fresh(received_s, run.pending)
                if isinstance(item, str):  # an end, and why
                    alerts += self._end(run_id, run, received_s, item)
                else:
                    alerts += self._heard(run_id, run, received_s, *item)
            alerts += self._fire(run_id, run, now_s, inclusive=True)
            if not run.pending and self._forgettable(run, now_s):
                del self._runs[run_id]
        return alerts

    # ------------------------------------------------------------------ state

    def _run(self, run_id: str, first_s: float) -> _Run:
        run = self._runs.get(run_id)
        if run is None:
            run = self._runs[run_id] = self._fresh(first_s, [])
        return run

    def _fresh(self, first_s: float, pending: list) -> _Run:
        run = _Run(first_heard_s=first_s, pending=pending)
        run.per_step_s = deque(maxlen=self.settings.window)
        return run

    def _forgettable(self, run: _Run, now_s: float) -> bool:
        if any(not r.gone and not run.ended for r in run.ranks.values()):
            return False
        last = max((r.heard_s for r in run.ranks.values()), default=run.first_heard_s)
        return now_s - last > self.settings.forget_s

    def _heard(
        self,
        run_id: str,
        run: _Run,
        t: float,
        rank: int,
        host: str,
        started: int,
        finished: int,
        phase: str,
    ) -> list[Alert]:
        old = run.ranks.get(rank)
        run.ranks[rank] = _Rank(host, t, started, finished, phase)
        self._pause_heard(run, old, phase, finished, t)
        heapq.heappush(run.deadlines, (t + self.settings.silence_s, rank, t))
        if math.isnan(run.progress_s):
            run.progress_s = t  # the hang clock starts when the run is first heard
        if phase == "ended":
            # Its last finished step counts: a run that finished steps since its last
            # heartbeat ends at its last step, not where the heartbeats last saw it.
            run.progress_step = max(run.progress_step, finished)
            return self._end(run_id, run, t, f"rank {rank} closed its monitor: the run ended")
        # A new process (a relaunch, a restart): its steps go back, or it attached anew.
        new_process = (
            old is None
            or finished < old.finished
            or started < old.started
            or (phase == "idle" and old.phase != "idle")
        )
        if run.ended and (phase == "exited" or (run.stopped and not new_process)):
            # A goodbye after the end, or a heartbeat of a stopped launch still on its way:
            # the rank ended with the run.
            run.ranks[rank].gone = True
            return []
        if run.ended:
            run.ended = False  # a rank at work after the end: the run was resumed
        if old is None:
            run.progress_step = max(run.progress_step, finished)  # joined mid-run: no progress
            return []
        if new_process:  # its steps are the job's from now
            run.progress_step, run.progress_s, run.starting = finished, t, True
            return []
        if finished > run.progress_step:
            return self._progress(run, t, finished)
        return []

    def _pause_heard(
        self, run: _Run, old: _Rank | None, phase: str, finished: int, t: float
    ) -> None:
        """A rank was heard in `phase` after `old`: a declared pause begins, or ends and its
        length is learned (from the first rank heard in it to the first heard out). A rank
        that finished steps since it was heard in a pause left it in between, even if it is
        in another pause of the same phase again: a fast job's heartbeats, 2 s apart, may
        never see it between two saves."""
        was = old.phase if old is not None else ""
        left = old is not None and was in PAUSES and (phase != was or finished > old.finished)
        if left:
            if phase not in PAUSES:
                run.pause_left_s = t  # the time in a declared pause is not the hang's
            began = run.pause_began_s.pop(was, None)
            back_to_work = phase not in ("exited", "ended", "idle")
            if began is not None and back_to_work and run.hang is None:
                run.longest_pause_s[was] = max(run.longest_pause_s.get(was, 0.0), t - began)
        if phase in PAUSES and (left or was != phase):
            run.pause_began_s.setdefault(phase, t)

    def pause_threshold_s(self, run: _Run, paused: tuple[str, ...]) -> tuple[float, str]:
        """Seconds a job may stay in the declared pause(s) `paused` before it is a hang,
        and why (for the message): the phase allowed the longest sets it."""
        s = self.settings
        out = (0.0, "")
        for phase in paused:
            longest = run.longest_pause_s.get(phase)
            if longest is None:
                limit = (s.pause_s, f"a declared {phase} pause, at most {s.pause_s:g} s")
            else:
                learned = min(s.pause_s, max(s.pause_intervals * longest, s.pause_floor_s))
                limit = (learned, (
                    f"a declared {phase} pause, {s.pause_intervals:g}x the longest this run "
                    f"came back from ({longest:.0f} s), at least {s.pause_floor_s:g} s and at "
                    f"most {s.pause_s:g} s"
                ))  # fmt: skip
            out = max(out, limit)
        return out

    def _progress(self, run: _Run, t: float, step: int) -> list[Alert]:
        """A step completed: the typical step time learns from it; open episodes end."""
        fresh = run.hang is None and run.lost is None and not run.starting
        if fresh and run.progress_step >= 0:
            run.per_step_s.append((t - run.progress_s) / (step - run.progress_step))
            run.observed_steps += step - run.progress_step
        run.progress_step, run.progress_s, run.starting = step, t, False
        why = f"step {step} completed: progress resumed"
        out = [_resolve(run, e, step + 1, t, why) for e in (run.hang, run.lost) if e]
        run.hang = run.lost = None
        for rank, r in list(run.ranks.items()):
            if r.gone:
                del run.ranks[rank]  # the job goes on without it
        return out

    def _end(self, run_id: str, run: _Run, t: float, why: str) -> list[Alert]:
        if run.ended:
            return []
        run.ended, run.stopped = True, why == STOPPED
        out = [_resolve(run, e, run.progress_step + 1, t, why) for e in (run.hang, run.lost) if e]
        run.hang = run.lost = None
        for r in run.ranks.values():
            r.gone = True  # they ended with the run: a relaunch's ranks are heard afresh
        return out

    # ------------------------------------------------------------------ deadlines

    def _knows_step_time(self, run: _Run) -> bool:
        """Whether the run's progress observations are enough to trust its typical step
        time: min_history of them, or two and more that saw min_history_steps steps."""
        seen = len(run.per_step_s)
        s = self.settings
        return seen >= s.min_history or (seen >= 2 and run.observed_steps >= s.min_history_steps)

    def hang_threshold_s(self, run: _Run) -> float:
        s = self.settings
        if run.starting or not self._knows_step_time(run):
            return s.first_step_s
        return max(s.hang_intervals * statistics.median(run.per_step_s), s.hang_floor_s)

    def _fire(
        self, run_id: str, run: _Run, before_s: float, inclusive: bool = False
    ) -> list[Alert]:
        """Every deadline of `run` earlier than `before_s` (a heartbeat received at a
        deadline is in time), or at it too (`inclusive`: the clock reads `before_s`), in
        time order."""
        out: list[Alert] = []
        while True:
            silence = self._next_silence(run)
            hang_at = math.inf
            paused: tuple[str, ...] = ()
            if not run.ended and run.hang is None and run.lost is None and run.ranks:
                since_s = max(run.progress_s, run.pause_left_s)
                hang_at = since_s + self.hang_threshold_s(run)
                if hang_at <= before_s:  # due: is the job in a declared pause? O(ranks)
                    paused = _declared_pause(run)
                    if paused:
                        pause_s, _ = self.pause_threshold_s(run, paused)
                        hang_at = max(hang_at, since_s + pause_s)
            at = min(silence[0] if silence else math.inf, hang_at)
            if at > before_s or (at == before_s and not inclusive):
                break
            if silence and silence[0] == at:
                heapq.heappop(run.deadlines)
                out += self._silent(run_id, run, at, silence[1])
            else:
                out.append(self._hang(run_id, run, at, paused))
        run.done_s = max(run.done_s, before_s)
        return out

    def _next_silence(self, run: _Run) -> tuple[float, int, float] | None:
        while run.deadlines:
            entry = run.deadlines[0]
            r = run.ranks.get(entry[1])
            if r is not None and not r.gone and r.heard_s == entry[2]:
                return entry
            heapq.heappop(run.deadlines)  # heard again since, gone already, or forgotten
        return None

    def _silent(self, run_id: str, run: _Run, at: float, rank: int) -> list[Alert]:
        r = run.ranks[rank]
        r.gone = True
        if run.ended or run.lost is not None or r.phase == "ended":
            return []  # a run or rank that ended; or torchrun tearing down the others
        where = f"at step {r.started} (last finished {r.finished}, phase {r.phase})"
        named: int | None = rank
        if not r.restored:
            how = (
                "said it was exiting without closing its monitor (an exception)"
                if r.phase == "exited"
                else "stopped sending heartbeats: a crash, a kill, a lost node or a frozen process"
            )
            message = (
                f"{rank_on(rank, r.host)} {how}; last heard {at - r.heard_s:.0f} s before this "
                f"alert, {where}. The first rank of the run to go silent: ranks that go silent "
                f"after it are most likely torn down because of it{self._with_it(run, at, rank)}"
            )
        elif any(not x.gone and not x.restored for x in run.ranks.values()):
            message = (
                f"{rank_on(rank, r.host)} has not been heard since the collector restarted, "
                f"{self.settings.silence_s:g} s before this alert, while other ranks of the run "
                f"have: it was lost while the collector was down. Last heard "
                f"{at - r.heard_s:.0f} s before this alert, {where}"
            )
        else:  # nobody heard since the restart: who went first is not known
            named = None
            message = (
                f"no rank of the run has been heard since the collector restarted, "
                f"{self.settings.silence_s:g} s before this alert: the run ended, crashed or "
                "lost its nodes while the collector was down, or cannot reach it now; which, "
                f"the collector cannot tell (what the ranks could not send waits in their "
                f"spools: `trainvitals import`). Last heard before the restart: "
                f"{rank_on(rank, r.host)}, {at - r.heard_s:.0f} s before this alert, {where}"
            )
        run.lost = Alert(
            run_id=run_id,
            step=_row_step(run, RANK_LOST, run.progress_step + 1),
            kind=RANK_LOST,
            severity="critical",
            message=message,
            time_unix_s=at,
            value=at - r.heard_s,
            rank=named,
        )
        return [run.lost]

    def _with_it(self, run: _Run, at: float, rank: int) -> str:
        """Said when other ranks have not been heard for half the silence either, none
        saying it was exiting: if they went silent with `rank` (a whole node or job lost),
        which comes first is chance. Names the host when every other rank on it is quiet."""
        half_s = self.settings.silence_s / 2
        alive = {
            k: x
            for k, x in run.ranks.items()
            if k != rank and not x.gone and x.phase not in ("exited", "ended")
        }
        quiet = {k for k, x in alive.items() if at - x.heard_s > half_s}
        if not quiet:
            return ""
        host = run.ranks[rank].host
        on_host = {k for k, x in alive.items() if host and x.host == host}
        if quiet == set(alive):
            return (
                f"; every other rank of the run ({len(quiet)}) has not been heard for over "
                f"{half_s:g} s either, none saying it was exiting: the whole job, or every "
                "node it ran on, was lost at once, and which rank comes first is chance"
            )
        if on_host and on_host <= quiet:
            return (
                f"; every other rank on {host} ({len(on_host)}) has not been heard for over "
                f"{half_s:g} s either, while ranks on other hosts have: {host} was lost "
                "(power, network, kernel) or all its processes were killed at once, and which "
                "of its ranks comes first is chance"
            )
        return (
            f"; {len(quiet)} other rank(s) have not been heard for over "
            f"{half_s:g} s either: if they went silent with it (a node or "
            "the whole job lost), which one comes first is chance"
        )

    def _hang(self, run_id: str, run: _Run, at: float, paused: tuple[str, ...] = ()) -> Alert:
        threshold_s = self.hang_threshold_s(run)
        named, why = _attribute({k: r for k, r in run.ranks.items() if not r.gone})
        waited = at - max(run.progress_s, run.pause_left_s)
        pause_s, pause_why = self.pause_threshold_s(run, paused)
        if paused and pause_s > threshold_s:
            threshold_s, typical = pause_s, pause_why
        elif run.starting:
            typical = f"{threshold_s:g} s for a new process's first step"
        elif not self._knows_step_time(run):
            typical = f"{threshold_s:g} s before the typical step time is known"
        else:
            typical = (
                f"{self.settings.hang_intervals:g}x the typical step time of "
                f"{statistics.median(run.per_step_s):.3g} s, at least "
                f"{self.settings.hang_floor_s:g} s"
            )
        run.hang = Alert(
            run_id=run_id,
            step=_row_step(run, HANG, run.progress_step + 1),
            kind=HANG,
            severity="critical",
            message=(
                f"no step completed for {waited:.0f} s ({typical}) while heartbeats go on: "
                f"step {run.progress_step + 1} is stuck; {why}"
            ),
            time_unix_s=at,
            value=waited,
            baseline=threshold_s,
            rank=named[0] if named else None,
        )
        return run.hang


def _row_step(run: _Run, kind: str, step: int) -> int:
    """The step of a new row of `kind`: `step`, or the one after the kind's last row when
    that is not earlier. The store keys alerts by (run, kind, step), so an episode that
    ends where it began (a run that ends without a step since) would lose its resolve."""
    step = max(step, run.row_steps.get(kind, step - 1) + 1)
    run.row_steps[kind] = step
    return step


def _resolve(run: _Run, episode: Alert, step: int, t: float, why: str) -> Alert:
    return episode.resolved_at(_row_step(run, episode.kind, step), t, why)


def _attribute(ranks: dict[int, _Rank]) -> tuple[list[int], str]:
    """(ranks the others wait for, in rank order; why) from the ranks' latest heartbeats."""
    if not ranks:
        return [], "no rank is heard any more"
    ahead = max(r.started for r in ranks.values())
    behind = sorted(k for k, r in ranks.items() if r.started < ahead)
    if behind:
        return behind, (
            f"{_names(ranks, behind)} not begun step {ahead}, which the other "
            f"{len(ranks) - len(behind)} rank(s) are in: they wait for {_them(behind)}"
        )
    free = sorted(k for k, r in ranks.items() if r.phase != "collective")
    if free and len(free) < len(ranks):
        return free, (
            f"{_names(ranks, free)} not entered the collective the other "
            f"{len(ranks) - len(free)} rank(s) wait in: they wait for {_them(free)}"
        )
    phases = Counter(r.phase for r in ranks.values())
    if not free:
        return [], (
            f"every rank ({len(ranks)}) waits in a collective: one that never completes "
            "(the network, or a rank outside the monitor)"
        )
    where = ", ".join(f"{p} ({n})" for p, n in sorted(phases.items()))
    return [], f"the whole job paused: all {len(ranks)} ranks in {where}"


def _declared_pause(run: _Run) -> tuple[str, ...]:
    """The declared pauses (PAUSES) that the ranks the job waits for are all in, or () when
    any of them is elsewhere: a pause declared by some ranks while the others wait in a
    collective for them is the job's pause; one that others wait for outside a collective
    (a barrier the loop did not declare) is not."""
    ranks = {k: r for k, r in run.ranks.items() if not r.gone}
    named, _ = _attribute(ranks)
    phases = {ranks[k].phase for k in (named or ranks)}
    return tuple(sorted(phases)) if phases and phases <= set(PAUSES) else ()


def _names(ranks: dict[int, _Rank], ids: list[int]) -> str:
    shown = ", ".join(
        f"{rank_on(k, ranks[k].host)} (step {ranks[k].started}, {ranks[k].phase})" for k in ids[:8]
    )
    more = f" and {len(ids) - 8} more" if len(ids) > 8 else ""
    return f"{shown}{more} {'has' if len(ids) == 1 else 'have'}"


def _them(ids: list[int]) -> str:
    return "it" if len(ids) == 1 else "them"
