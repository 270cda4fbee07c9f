"""One alert through the supervisor's policy, without a job: what it records, and what it
refuses. A collector in memory stands in for the API (the real one: test_recovery.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainvitals.supervisor import agent
from trainvitals.supervisor.agent import Launch, Supervisor
from trainvitals.supervisor.alerts import Alert
from trainvitals.supervisor.fence import FenceList
from trainvitals.supervisor.launch import JobCommand, JobError
from trainvitals.supervisor.policy import Policy, PolicyError

JOB = ["-m", "trainvitals.trainer.train", "--dp", "2", "--run-id", "run-a", "--resume"]


class MemoryCollector:
    """The collector's API for one run, in memory: alerts given, events recorded."""

    def __init__(self, alerts: list[Alert] = (), behind_polls: int = 0) -> None:
        self._alerts = list(alerts)
        self.events: list[tuple[str, int, int, dict]] = []
        self.behind_polls = behind_polls  # progress polls that find the analysis behind
        self.progress_polls = 0

    def caught_up(self) -> bool:
        self.progress_polls += 1
        return self.progress_polls > self.behind_polls

    def alerts(self) -> list[Alert]:
        return self._alerts

    def last_step(self) -> int:
        return 30

    def canary_steps(self, before_step: int) -> list[int]:
        return [s for s in range(0, before_step, 5)]

    def event(self, kind: str, step: int, rank: int = -1, detail: dict | None = None) -> None:
        self.events.append((kind, step, rank, detail or {}))


def supervisor(tmp_path: Path, policy: Policy, collector: MemoryCollector, **kw) -> Supervisor:
    job = JobCommand([*JOB, "--checkpoint-dir", str(tmp_path / "ckpt")])
    nodes = ["node0", "node1"]
    sup = Supervisor(
        job,
        nodes,
        2,
        policy,
        collector,
        FenceList(None, nodes, policy.limits.max_fenced_fraction),
        tmp_path,
        clock=lambda: 500.0,
    )
    sup.launches.append(Launch(0, nodes, started_unix_s=0.0))
    return sup


def sdc(run_id: str = "run-a", kind: str = "sdc", rank: int | None = 2) -> Alert:
    return Alert(run_id, kind, 20, "critical", 400.0, "rank 2 disagrees", rank=rank)


def act(kind: str, **limits) -> Policy:
    return Policy.from_dict({"limits": limits, "kinds": {kind: {"mode": "act"}}})


def test_observe_records_the_recommendation_and_does_nothing(tmp_path: Path) -> None:
    collector = MemoryCollector()
    sup = supervisor(tmp_path, Policy(), collector)
    assert sup.handle(sdc()) is False
    ((kind, step, rank, detail),) = collector.events
    assert (kind, step, rank) == ("action:observe:sdc", 20, 2)
    # The last canary before step 20 ran at step 15: the state after it is known clean.
    assert detail["recommend"] == (
        "fence node1, roll back to the last checkpoint at or before step 15"
    )
    assert sup.fences.fenced == {} and len(sup.launches) == 1
    assert sup.handle(sdc()) is False and len(collector.events) == 1  # seen: once


def test_an_alert_for_another_run_is_refused(tmp_path: Path) -> None:
    collector = MemoryCollector()
    sup = supervisor(tmp_path, act("sdc"), collector)
    with pytest.raises(ValueError, match="alert for run 'run-b'; this supervisor runs 'run-a'"):
        sup.handle(sdc(run_id="run-b"))
    assert collector.events == [] and sup.fences.fenced == {}


def test_an_alert_of_an_unknown_kind_is_refused(tmp_path: Path) -> None:
    collector = MemoryCollector()
    sup = supervisor(tmp_path, act("sdc"), collector)
    with pytest.raises(PolicyError, match="unknown alert kind 'sdc_v2'"):
        sup.handle(sdc(kind="sdc_v2"))
    assert collector.events == []
    # From the poll too: logged, nothing done, the loop goes on.
    collector._alerts = [sdc(kind="sdc_v2")]
    assert sup._check_alerts() is False and collector.events == []


def test_a_fence_over_the_share_is_refused_as_an_event(tmp_path: Path) -> None:
    collector = MemoryCollector()
    sup = supervisor(tmp_path, act("sdc", max_fenced_fraction=0.4), collector)
    assert sup.handle(sdc()) is False
    ((kind, _, _, detail),) = collector.events
    assert kind == "action:refused" and "max_fenced_fraction" in detail["why"]
    assert sup.fences.fenced == {} and len(sup.launches) == 1


def test_no_restarts_left_is_refused_as_an_event(tmp_path: Path) -> None:
    collector = MemoryCollector()
    sup = supervisor(tmp_path, act("sdc", max_restarts_per_hour=0), collector)
    assert sup.handle(sdc()) is False
    assert collector.events[0][0] == "action:refused"
    assert "max_restarts_per_hour" in collector.events[0][3]["why"]


def test_liveness_alerts_of_ranks_the_supervisor_stopped_are_not_acted_on(tmp_path: Path) -> None:
    collector = MemoryCollector()
    sup = supervisor(tmp_path, act("rank_lost"), collector)
    sup.launches[0].stop_began_unix_s = 390.0
    sup.launches.append(Launch(1, ["node0"], started_unix_s=395.0))
    # Last heard at 391 (deadline 397 less 6 s of silence): while it was being stopped.
    lost = Alert("run-a", "rank_lost", 30, "critical", 397.0, rank=3, value=6.0)
    assert sup.handle(lost) is False and collector.events == []


def test_a_job_command_without_resume_is_refused(tmp_path: Path) -> None:
    job = JobCommand(["-m", "x", "--run-id", "r", "--checkpoint-dir", str(tmp_path)])
    with pytest.raises(JobError, match="needs --run-id, --checkpoint-dir and --resume"):
        job.check(2)
    with pytest.raises(JobError, match="multiple of the 2 nodes"):
        JobCommand([*JOB[:3], "3", *JOB[4:], "--checkpoint-dir", "c"]).check(2)


def test_the_relaunch_scales_dp_and_adds_the_skipped_data() -> None:
    job = JobCommand(["-m", "t", "--dp=4", "--tp", "2", "--run-id", "r"], skip_data=["20:39"])
    assert job.for_nodes(1, 2) == ["-m", "t", "--tp", "2", "--run-id", "r", "--dp", "2",
                                   "--skip-data", "20:39"]  # fmt: skip


def diverging() -> Alert:
    return Alert("run-a", "loss_diverging", 79, "warning", 450.0, "climbing", start_step=62)


def test_a_job_that_ended_well_gets_a_last_look_once_its_steps_are_analysed(
    tmp_path: Path,
) -> None:
    # The alert raised by the job's last steps is in the collector only once it has
    # analysed them: the look waits for that, then handles it.
    collector = MemoryCollector([diverging()], behind_polls=2)
    sup = supervisor(tmp_path, Policy(), collector)
    sup.poll_s = 0.001
    assert sup._last_look() is False  # observed: nothing to relaunch
    assert collector.progress_polls == 3
    ((kind, step, _, detail),) = collector.events
    assert (kind, step) == ("action:observe:loss_diverging", 79)
    assert "roll back" in detail["recommend"]


def test_the_last_look_waits_a_bounded_time_for_an_analysis_that_never_catches_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent, "LAST_LOOK_S", 0.01)
    collector = MemoryCollector([diverging()], behind_polls=10**9)
    sup = supervisor(tmp_path, Policy(), collector)
    sup.poll_s = 0.001
    assert sup._last_look() is False
    assert collector.progress_polls == 10  # LAST_LOOK_S / poll_s, then it looks anyway
    assert [e[0] for e in collector.events] == ["action:observe:loss_diverging"]
