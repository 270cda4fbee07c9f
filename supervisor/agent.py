"""The supervisor: runs the job, reads its alerts, applies the policy, records every action.

    launch on the nodes not fenced -> poll the collector's alerts (or wake on a webhook)
      -> new alert: observe (recommend: an event) or act within the limits:
         stop the job, fence the node, roll the checkpoints back, relaunch
      -> the job failed on its own: wait for the liveness alert that names the node
      -> the job ended well: once the collector has analysed its last steps, a last look
         at the alerts (a divergence found at the end still rolls back), then done

Events (kinds), all at the run's step where it happened: `action:observe:<alert kind>`
(what the policy recommends), `action:refused` (an action the limits or the fence list
refused, and why), `action:stop` (the job stopped to act: sent before the ranks are
stopped, so the collector's watchdog does not take their silence for lost ranks),
`action:rerun` (a loss spike's or NaN's step re-run from the checkpoint
before it: the stored and re-run losses, data or hardware), `action:fence` (node, rank,
why), `action:rollback` (from step, to checkpoint, steps to redo, data skipped),
`action:relaunch` (nodes, seconds stopped); the relaunched trainer's own `restart` event
marks training resumed.

Alerts of the supervisor's own doing are not acted on: the liveness alerts of ranks it
stopped (last heard while it was stopping them), alerts from a launch it already stopped
and rolled back, and alerts it has seen.
"""

from __future__ import annotations

import math
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainvitals.analyzer.liveness import STOP_EVENT
from trainvitals.trainer import checkpoint

from .actions import Limiter, Plan, classify, plan
from .alerts import Alert, CollectorClient
from .fence import FenceError, FenceList
from .launch import Agents, JobCommand
from .policy import AUTOMATED, FENCE_ROLLBACK, RERUN, RESPONSES, Policy

# How long a job that ended well waits for the collector to analyse its last steps: a step
# is analysed 1 s after it is stored, or up to 10 s when a node's ranks rows are late
# (analyzer/live.py), and the last batches are stored as the job exits.
LAST_LOOK_S = 30.0
RERUN_TIMEOUT_S = 900.0  # a re-run replays at most a checkpoint interval of steps
HEARTBEAT_SLACK_S = 2.5  # the hooks' heartbeat interval (2 s) and a little: last heard
LIVENESS = ("rank_lost", "hang")


@dataclass
class Launch:
    """One launch of the job: its nodes and when it ran (the supervisor's clock)."""

    generation: int
    nodes: list[str]
    started_unix_s: float
    stop_began_unix_s: float | None = None  # a deliberate stop (an action), not a failure
    stopped_unix_s: float | None = None


@dataclass
class Supervisor:
    job: JobCommand
    nodes: list[str]
    nproc_per_node: int
    policy: Policy
    collector: CollectorClient
    fences: FenceList
    log_dir: Path
    poll_s: float = 1.0
    wake: threading.Event = field(default_factory=threading.Event)
    clock: Callable[[], float] = time.time
    log: Callable[[str], None] = lambda line: print(f"supervisor: {line}", flush=True)

    def __post_init__(self) -> None:
        self.job.check(len(self.nodes))
        self.run_id = self.job.value("--run-id")
        self.checkpoint_dir = Path(self.job.value("--checkpoint-dir"))
        self.limiter = Limiter(self.policy.limits, self.clock)
        self.launches: list[Launch] = []
        self.seen: set[tuple] = set()
        self.refused: set[tuple] = set()
        self.agents: Agents | None = None
        self.stop_step = -1  # step of the last `action:stop` event (events are keyed by step)

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        """Supervise until the job ends well (0) or cannot go on (its exit code)."""
        self._launch()
        while True:
            code = self.agents.poll()
            if code == 0:
                if self._last_look():
                    continue  # an alert raised by the job's last steps: relaunched
                self.log(f"run {self.run_id} finished on {', '.join(self.launches[-1].nodes)}")
                return 0
            if self._check_alerts():
                continue  # relaunched
            if code is not None and not self._after_failure(code):
                return code
            self.wake.wait(self.poll_s)
            self.wake.clear()

    def _launch(self) -> None:
        nodes = self.fences.remaining()
        argv = self.job.for_nodes(len(nodes), len(self.nodes))
        gen = len(self.launches)
        self.launches.append(Launch(gen, nodes, self.clock()))
        self.agents = Agents(nodes, self.nproc_per_node, argv, self.log_dir, f"gen{gen}")
        self.log(f"launch {gen}: {len(nodes)} node(s) {', '.join(nodes)}: {' '.join(argv)}")

    def _check_alerts(self) -> bool:
        """Handle the alerts not seen yet; True if one led to a relaunch."""
        try:
            alerts = self.collector.alerts()
        except Exception as e:
            self.log(f"cannot read alerts from the collector: {e}")
            return False
        for a in alerts:
            try:
                if self.handle(a):
                    return True
            except ValueError as e:  # another run's, or a kind no policy knows: refused
                if a.key not in self.refused:
                    self.refused.add(a.key)
                    self.log(f"refused alert {a.kind} at step {a.step}: {e}")
        return False

    def _last_look(self) -> bool:
        """The job ended well: wait until the collector has analysed its last steps (at
        most LAST_LOOK_S), then handle the alerts they raised. True if one led to a
        relaunch. Without it, a job that finished while its last alert was on its way (a
        divergence found a step before the end) was declared finished, not rolled back."""
        for _ in range(max(1, math.ceil(LAST_LOOK_S / self.poll_s))):
            try:
                if self.collector.caught_up():
                    break
            except Exception as e:
                self.log(f"cannot read the collector's analysis progress: {e}")
            time.sleep(self.poll_s)
        else:
            self.log(f"the collector has not analysed the job's last steps in {LAST_LOOK_S:.0f} s")
        self.log("the job ended well: a last look at its alerts")
        return self._check_alerts()

    def _after_failure(self, code: int) -> bool:
        """The job failed on its own: wait for the alert naming the culprit (and act on it),
        else relaunch without fencing if the policy acts on rank_lost. False: give up."""
        self.log(f"the job failed (exit code {code}); waiting for the alert that names the rank")
        self.agents.stop()
        deadline = self.clock() + self.policy.limits.failure_wait_s
        while self.clock() < deadline:
            if self._check_alerts():
                return True
            time.sleep(self.poll_s)
        if self.policy.for_kind("rank_lost").mode != "act":
            self.log("no alert named a rank, and rank_lost is observed only: giving up")
            return False
        refusal = self.limiter.refusal()
        if refusal:
            self.log(f"not relaunching: {refusal}")
            return False
        self.limiter.record()
        step = self._progress()
        self.collector.event("action:relaunch", step, detail={"why": f"exit code {code}, no alert"})
        self._launch()
        return True

    # ------------------------------------------------------------------ one alert

    def handle(self, alert: Alert) -> bool:
        """Apply the policy to one alert; True if the job was relaunched. ValueError for an
        alert of another run or of an unknown kind: refused, nothing done."""
        if alert.run_id != self.run_id:
            raise ValueError(
                f"alert for run {alert.run_id!r}; this supervisor runs {self.run_id!r}"
            )
        kind_policy = self.policy.for_kind(alert.kind)  # PolicyError: an unknown kind
        if alert.severity == "resolved" or alert.key in self.seen:
            return False
        self.seen.add(alert.key)
        launch = self._launch_of(alert)
        why = self._own_doing(alert, launch)
        if why:
            self.log(f"not acting on {alert.kind} at step {alert.step}: {why}")
            return False
        response = RESPONSES[alert.kind]
        try:
            canaries = (
                self.collector.canary_steps(alert.onset_step) if response == FENCE_ROLLBACK else []
            )
            p = plan(alert, kind_policy, launch.nodes, self.nproc_per_node, canaries)
        except ValueError as e:  # what its response needs is missing (a rank to fence)
            if kind_policy.mode != "act":
                self._observe(alert, response, f"{response} ({e})")
                return False
            return self._refuse(alert, str(e))
        if p.node is not None and p.node in self.fences.fenced:
            self.log(f"{alert.kind} at step {alert.step}: {p.node} is fenced already")
            return False
        if kind_policy.mode != "act" or response not in AUTOMATED:
            self._observe(alert, response, p.describe() if response in AUTOMATED else response)
            return False
        refusal = self.limiter.refusal()
        if refusal is None and p.node is not None:
            try:
                self.fences.check(p.node)
            except FenceError as e:
                refusal = str(e)
        if refusal:
            return self._refuse(alert, refusal, p)
        self._act(p)
        return True

    def _observe(self, alert: Alert, response: str, recommend: str) -> None:
        self.log(f"observe {alert.kind} at step {alert.step}: recommend {recommend}")
        self.collector.event(
            f"action:observe:{alert.kind}",
            alert.step,
            -1 if alert.rank is None else alert.rank,
            {"response": response, "recommend": recommend, "alert": alert.message[:500]},
        )

    def _launch_of(self, alert: Alert) -> Launch:
        """The launch that raised an alert: the last one started before its evidence."""
        t = alert.evidence_unix_s
        started = [x for x in self.launches if x.started_unix_s <= t]
        return started[-1] if started else self.launches[0]

    def _own_doing(self, alert: Alert, launch: Launch) -> str | None:
        if launch.stop_began_unix_s is None:
            return None
        if alert.kind in LIVENESS:
            heard = alert.evidence_unix_s
            if heard >= launch.stop_began_unix_s - HEARTBEAT_SLACK_S:
                return "its ranks went silent because the supervisor stopped them"
        return f"raised by launch {launch.generation}, which was stopped and rolled back already"

    def _refuse(self, alert: Alert, why: str, p: Plan | None = None) -> bool:
        self.log(f"refused to act on {alert.kind} at step {alert.step}: {why}")
        detail = {"alert": alert.kind, "why": why}
        if p is not None:
            detail["recommend"] = p.describe()
        self.collector.event("action:refused", alert.step, -1, detail)
        return False

    def _act(self, p: Plan) -> None:
        a, launch = p.alert, self.launches[-1]
        self.log(f"act on {a.kind} at step {a.step} (rank {a.rank}): {p.describe()}")
        self.limiter.record()
        launch.stop_began_unix_s = self.clock()
        self._say_stopping(p, launch)
        self.agents.stop()
        launch.stopped_unix_s = self.clock()
        reached = self._progress()
        skip_steps = (self._resume_step_after(p), reached) if p.skip_data else None
        if p.response == RERUN:
            result = self._rerun(p)
            rank = -1 if a.rank is None else a.rank
            self.collector.event("action:rerun", a.step, rank, result)
            if result["verdict"] != "hardware":  # fence nobody without the evidence
                p = replace(p, node=None)
            if result["verdict"] == "data":  # the batch: skip it
                skip_steps = (a.step, a.step)
        if p.node is not None:
            reason = f"{a.kind} at step {a.step}" + (
                f" (rank {a.rank})" if a.rank is not None else ""
            )
            self.fences.fence(p.node, reason, self.clock())
            detail = {"node": p.node, "why": reason, "message": a.message[:500]}
            self.collector.event("action:fence", a.step, -1 if a.rank is None else a.rank, detail)
        if p.rollback_at_most_step is None:
            kept = max(checkpoint.complete(self.checkpoint_dir), default=None)
        else:
            kept = checkpoint.roll_back(self.checkpoint_dir, p.rollback_at_most_step)
        resume_step = 0 if kept is None else kept + 1
        window = None
        if skip_steps is not None:
            from trainvitals.trainer.data import data_index, parse_windows

            skipped = parse_windows(self.job.skip_data)
            first, last = skip_steps
            if last >= first:
                window = f"{data_index(first, skipped)}:{data_index(last, skipped)}"
                self.job.skip_data.append(window)
        detail = {
            "from_step": reached,
            "to_checkpoint_step": kept,
            "resume_step": resume_step,
            "redone_steps": max(0, reached - resume_step + 1),
            "skip_data": window,
            "why": f"{a.kind} at step {a.step}",
        }
        self.collector.event("action:rollback", reached, -1, detail)
        self._launch()
        stopped_s = self.clock() - launch.stop_began_unix_s
        relaunch = {"nodes": self.launches[-1].nodes, "stopped_s": stopped_s}
        relaunch["alert_to_relaunch_s"] = self.clock() - a.time_unix_s
        self.collector.event("action:relaunch", reached, -1, relaunch)

    def _say_stopping(self, p: Plan, launch: Launch) -> None:
        """The `action:stop` event, stored before the ranks are stopped: the collector's
        liveness watchdog takes their silence as this stop, not as ranks lost (which a
        relaunch on fewer nodes would leave the fenced node's ranks). Not sent when the job
        failed on its own (`_after_failure`): the alert naming the culprit must come."""
        self.stop_step = max(self._progress(), self.stop_step + 1)  # one row per stop
        why = f"{p.alert.kind} at step {p.alert.step}: {p.describe()}"
        detail = {"why": why, "nodes": launch.nodes, "launch": launch.generation}
        self.collector.event(STOP_EVENT, self.stop_step, -1, detail)

    def _resume_step_after(self, p: Plan) -> int:
        """The step a rollback to `p` resumes at (before moving anything)."""
        done = checkpoint.complete(self.checkpoint_dir)
        at_most = p.rollback_at_most_step
        kept = [c for c in done if at_most is None or c <= at_most]
        return kept[-1] + 1 if kept else 0

    def _rerun(self, p: Plan) -> dict:
        """Re-run the alert's step (same batch, same weights: from the checkpoint before it,
        the steps between replayed) on the nodes left less the suspect's; its loss against
        the stored one says data (reproduces) or hardware (does not)."""
        step = p.alert.step
        nodes = [n for n in self.fences.remaining() if n != p.node] or self.fences.remaining()
        view = self.log_dir / f"rerun-{step}-checkpoints"  # the checkpoint before the step only
        shutil.rmtree(view, ignore_errors=True)
        view.mkdir(parents=True)
        before = [c for c in checkpoint.complete(self.checkpoint_dir) if c < step]
        if before:
            source = checkpoint.path_of(self.checkpoint_dir, before[-1]).resolve()
            (view / source.name).symlink_to(source)
            (view / "latest").write_text(source.name)
        argv = self.job.for_rerun(len(nodes), len(self.nodes), str(view), step)
        self.log(f"re-run step {step} on {', '.join(nodes)}: {' '.join(argv)}")
        agents = Agents(nodes, self.nproc_per_node, argv, self.log_dir, f"rerun{step}")
        deadline = self.clock() + RERUN_TIMEOUT_S
        while agents.poll() is None and self.clock() < deadline:
            time.sleep(self.poll_s)
        agents.stop()
        rerun = _rerun_loss(agents.logs[0], step)
        stored = self._stored_loss(step)
        verdict = classify(stored, rerun)
        self.log(f"re-run of step {step}: loss {rerun} against {stored} stored: {verdict}")
        return {"step": step, "stored_loss": stored, "rerun_loss": rerun,
                "verdict": verdict, "nodes": nodes}  # fmt: skip

    def _stored_loss(self, step: int) -> float | None:
        try:
            return self.collector.step_loss(step)
        except Exception as e:
            self.log(f"cannot read the loss of step {step}: {e}")
            return None

    def _progress(self) -> int:
        """The newest step the job reached, as the collector holds it (0 if unknown)."""
        try:
            return self.collector.last_step() or 0
        except Exception as e:
            self.log(f"cannot read the run's progress: {e}")
            return 0


def _rerun_loss(log: Path, step: int) -> float | None:
    """The loss a re-run printed (`rerun-loss STEP LOSS`, trainer/train.py), if it did."""
    if not log.exists():
        return None
    for line in log.read_text(errors="replace").splitlines():
        words = line.split()
        if len(words) == 3 and words[0] == "rerun-loss" and words[1] == str(step):
            return float(words[2])
    return None
