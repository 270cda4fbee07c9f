"""From an alert to a plan, and the limits, with an injected clock."""

from __future__ import annotations

import pytest

from trainvitals.supervisor.actions import Limiter, classify, clean_before_sdc, node_of, plan
from trainvitals.supervisor.alerts import Alert
from trainvitals.supervisor.policy import KindPolicy, Limits

NODES = ["node0", "node1"]


def alert(kind: str, step: int, rank: int | None = None, start: int | None = None) -> Alert:
    return Alert("r", kind, step, "critical", 1000.0, rank=rank, start_step=start)


def test_a_rank_names_its_node_in_launch_order() -> None:
    assert [node_of(r, NODES, 2) for r in range(4)] == ["node0", "node0", "node1", "node1"]
    assert node_of(4, NODES, 2) is None


def test_sdc_fences_and_rolls_back_to_before_the_last_agreeing_canary() -> None:
    p = plan(alert("sdc", 20, rank=2), KindPolicy("act"), NODES, 2, canary_steps=[0, 5, 10, 15])
    assert (p.node, p.rollback_at_most_step) == ("node1", 15)
    # No canary before the evidence: nothing is known clean, start again from scratch.
    assert clean_before_sdc(alert("sdc", 5, rank=2), [5]) == -1


def test_a_lost_rank_fences_and_resumes_from_the_latest() -> None:
    p = plan(alert("rank_lost", 17, rank=1), KindPolicy("act"), NODES, 2)
    assert (p.node, p.rollback_at_most_step) == ("node0", None)


def test_a_hang_fences_the_rank_the_others_wait_for_and_resumes_from_the_latest() -> None:
    p = plan(alert("hang", 40, rank=3, start=40), KindPolicy("act"), NODES, 2)
    assert (p.node, p.rollback_at_most_step) == ("node1", None)
    # A whole-job pause names no rank (the watchdog names the phase): nothing to fence.
    with pytest.raises(ValueError, match="hang at step 40 names no rank"):
        plan(alert("hang", 40), KindPolicy("act"), NODES, 2)


def test_divergence_rolls_back_to_before_the_onset_and_fences_nothing() -> None:
    p = plan(alert("loss_diverging", 35, start=27), KindPolicy("act", skip_data=True), NODES, 2)
    assert (p.node, p.rollback_at_most_step, p.skip_data) == (None, 26, True)


def test_an_alert_without_a_rank_cannot_fence() -> None:
    with pytest.raises(ValueError, match="names no rank"):
        plan(alert("sdc", 20), KindPolicy("act"), NODES, 2)


def test_restarts_an_hour_and_cooldown() -> None:
    now = [0.0]
    limiter = Limiter(Limits(max_restarts_per_hour=2, cooldown_s=60), clock=lambda: now[0])
    assert limiter.refusal() is None
    limiter.record()
    now[0] = 30
    assert "cooldown_s" in limiter.refusal()
    now[0] = 61
    assert limiter.refusal() is None
    limiter.record()
    now[0] = 200
    assert "max_restarts_per_hour" in limiter.refusal()
    now[0] = 3601  # the first has left the hour
    assert limiter.refusal() is None


def test_a_spike_is_re_run_from_the_weights_it_started_from() -> None:
    p = plan(alert("loss_spike", 24), KindPolicy("act"), NODES, 2)
    assert (p.node, p.rollback_at_most_step) == (None, 23)
    p = plan(alert("nonfinite", 24, rank=3), KindPolicy("act"), NODES, 2)
    assert p.node == "node1"  # the suspect, fenced only if the re-run says hardware


def test_a_re_run_that_reproduces_the_loss_is_the_data() -> None:
    assert classify(7.038474798, 7.038475037) == "data"
    assert classify(None, float("nan")) == "data"  # NaN stored (served as null) and again
    assert classify(7.04, 2.61) == "hardware"  # the spike did not come back
    assert classify(None, 2.61) == "hardware"
    assert classify(2.61, float("inf")) == "hardware"
    assert classify(7.04, None) == "unknown"  # the re-run printed no loss
