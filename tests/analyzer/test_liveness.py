"""The liveness watchdog on heartbeats with a simulated clock: who is named, when, and that
the alert times depend on the heartbeats only (live ticks and one replay pass agree)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from trainvitals.analyzer.alerts import Alert
from trainvitals.analyzer.liveness import STOPPED, LivenessSettings, Watchdog
from trainvitals.schema import heartbeats_to_arrow

STEP_S = 0.1  # the simulated job's step time
EVERY_S = 2.0  # heartbeat interval
# rank, time -> (started, finished, phase), or None once the rank is silent
State = Callable[[int, float], tuple[int, int, str] | None]


def running(rank: int, t: float) -> tuple[int, int, str]:
    step = int(t / STEP_S)
    return step, step - 1, "forward"


def heartbeats(state: State, ranks: int, until_s: float) -> list[tuple[float, int, tuple]]:
    """(receive time, rank, (started, finished, phase)), each rank every EVERY_S, offset."""
    out = []
    for rank in range(ranks):
        t = 0.3 * rank
        while t <= until_s:
            s = state(rank, t)
            if s is not None:
                out.append((t, rank, s))
            t += EVERY_S
    return sorted(out)


def feed(
    beats: list[tuple[float, int, tuple]],
    tick_s: float | None,
    until_s: float,
    stops: tuple[float, ...] = (),
    **settings,
) -> list:
    """Alerts of a watchdog fed `beats` (and the supervisor's `stops`, at their times):
    live-like (one advance every `tick_s`, each beat and stop delivered when received) or
    in one pass (tick_s None, as replay does)."""
    dog = Watchdog(LivenessSettings(**settings))
    alerts = []
    ticks = [until_s] if tick_s is None else [i * tick_s for i in range(int(until_s / tick_s) + 1)]
    i = 0
    stops_left = sorted(stops)
    for now in ticks:
        while i < len(beats) and beats[i][0] <= now:
            t, rank, (started, finished, phase) = beats[i]
            doc = {
                "schema_version": 1,
                "run_id": "r1",
                "heartbeats": {
                    "rank": [rank],
                    "time_unix_s": [t],
                    "host": [f"node{rank // 2}"],
                    "step_started": [started],
                    "step_finished": [finished],
                    "phase": [phase],
                },
            }
            dog.observe(*heartbeats_to_arrow(doc, t))
            i += 1
        while stops_left and stops_left[0] <= now:  # after the beats: the run is known
            dog.end_run("r1", stops_left.pop(0), STOPPED)
        alerts += dog.advance(now)
    return alerts


def kinds(alerts: list) -> list[tuple[str, str, int | None]]:
    return [(a.kind, a.severity, a.rank) for a in alerts]


def test_a_crash_names_the_first_rank_to_go_silent_once() -> None:
    # rank 2 dies at 60 s; torchrun tears the others down 1-3 s later.
    def state(rank: int, t: float):
        if t > {2: 60.0, 0: 61.0, 1: 62.0, 3: 63.0}[rank]:
            return None
        return running(rank, t)

    beats = heartbeats(state, 4, 120)
    alerts = feed(beats, 0.5, 120)
    assert kinds(alerts) == [("rank_lost", "critical", 2)]
    last_heard = max(t for t, r, _ in beats if r == 2)
    assert alerts[0].time_unix_s == last_heard + 10.0  # deadline, not the tick
    assert "rank 2 on node1" in alerts[0].message


def test_the_crashed_rank_is_named_even_when_the_others_say_goodbye_first() -> None:
    # The others exit on the broken collective a moment after the crash and say so.
    beats = heartbeats(lambda r, t: None if r == 1 and t > 40 else running(r, t), 4, 40.2)
    beats += [(40.9 + 0.1 * r, r, (400, 399, "exited")) for r in (0, 2, 3)]
    alerts = feed(sorted(beats), 0.5, 90)
    assert kinds(alerts) == [("rank_lost", "critical", 1)]
    assert "other rank(s) have not been heard" not in alerts[0].message  # they said goodbye


def test_ranks_silent_together_are_said_to_be() -> None:
    # A whole job killed at once (kill -9 of every rank, a node lost): all go silent at
    # 60 s without a goodbye, and which one is named first is chance; the alert says so.
    alerts = feed(heartbeats(lambda r, t: running(r, t) if t <= 60 else None, 4, 120), 0.5, 120)
    assert kinds(alerts) == [("rank_lost", "critical", 1)]  # heard last the longest ago
    assert "every other rank of the run (3) has not been heard for over 5 s" in alerts[0].message
    assert "the whole job, or every node it ran on, was lost at once" in alerts[0].message


def test_a_lost_node_is_named_by_its_host() -> None:
    # node1 (ranks 2 and 3) lost at 60 s; node0's ranks go on sending heartbeats (blocked
    # in a collective, as a real job's would be).
    def state(rank: int, t: float):
        if rank >= 2 and t > 60:
            return None
        return running(rank, min(t, 60))

    alerts = feed(heartbeats(state, 4, 120), 0.5, 120)
    assert [a.kind for a in alerts] == ["rank_lost"] and alerts[0].rank in (2, 3)
    message = alerts[0].message
    assert "every other rank on node1 (1) has not been heard for over 5 s either" in message
    assert "node1 was lost" in message


def test_some_ranks_quiet_elsewhere_are_only_counted() -> None:
    # Ranks 1 and 3 (one on each node) go silent at 60 s: neither a whole node nor the run.
    alerts = feed(heartbeats(lambda r, t: running(r, t) if r % 2 == 0 or t <= 60 else None, 4,
                             120), 0.5, 120)  # fmt: skip
    assert alerts[0].kind == "rank_lost" and alerts[0].rank in (1, 3)
    assert "1 other rank(s) have not been heard for over 5 s either" in alerts[0].message


def test_a_hang_names_the_rank_the_others_wait_for_and_resolves() -> None:
    # rank 3 stops before step 300 (30 s in); the others begin it and wait in a collective.
    # At 100 s rank 3 goes on.
    def state(rank: int, t: float):
        if t < 30 or t >= 100:
            return running(rank, t if t < 30 else t - 70)
        if rank == 3:
            return 299, 299, "data_wait"
        return 300, 299, "collective"

    alerts = feed(heartbeats(state, 4, 130), 0.5, 130)
    assert kinds(alerts) == [("hang", "critical", 3), ("hang", "resolved", 3)]
    hang, resolved = alerts
    assert "rank 3 on node1 (step 299, data_wait) has not begun step 300" in hang.message
    assert hang.step == 300 and resolved.step > hang.step and resolved.start_step == 300
    assert 30 <= hang.value <= 35  # the 30 s floor: 10 x 0.1 s steps is less


def test_a_hang_names_the_rank_outside_the_collective() -> None:
    def state(rank: int, t: float):
        if t < 30:
            return running(rank, t)
        return 300, 299, "backward" if rank == 1 else "collective"

    (hang,) = feed(heartbeats(state, 4, 90), 1.0, 90)
    assert (hang.kind, hang.rank) == ("hang", 1)
    assert "has not entered the collective the other 3 rank(s) wait in" in hang.message


def test_a_whole_job_pause_names_nobody_and_says_the_phase() -> None:
    def state(rank: int, t: float):
        return running(rank, t) if t < 30 else (300, 299, "data_wait")

    (hang,) = feed(heartbeats(state, 4, 90), 1.0, 90)
    assert hang.rank is None
    assert "the whole job paused: all 4 ranks in data_wait (4)" in hang.message


def test_a_declared_pause_of_the_whole_job_gets_pause_s_not_a_steps_threshold() -> None:
    # Every rank saves a checkpoint from 30 s to 150 s (declared), then trains on: no hang
    # at the 30 s floor. Undeclared, the same pause is a hang.
    def state(phase: str):
        def at(rank: int, t: float):
            if 30 <= t < 150:
                return 300, 299, phase
            return running(rank, t if t < 30 else t - 120)

        return at

    assert feed(heartbeats(state("checkpoint"), 4, 200), 1.0, 200) == []
    assert kinds(feed(heartbeats(state("data_wait"), 4, 200), 1.0, 200)) == [
        ("hang", "critical", None),
        ("hang", "resolved", None),
    ]


def test_the_time_in_a_declared_pause_does_not_count_towards_a_hang_after_it() -> None:
    # A save from 30 s to 150 s, then the job stops in data_wait without a step: the hang
    # is a full threshold after the save ended, not at once for the time since step 299.
    def state(rank: int, t: float):
        if t < 30:
            return running(rank, t)
        return 300, 299, "checkpoint" if t < 150 else "data_wait"

    (hang,) = feed(heartbeats(state, 4, 250), 1.0, 250)
    assert 180 <= hang.time_unix_s <= 182 and 30 <= hang.value <= 31


def test_a_declared_pause_that_lasts_past_pause_s_is_a_hang_saying_so() -> None:
    def state(rank: int, t: float):
        return running(rank, t) if t < 30 else (300, 299, "eval")

    (hang,) = feed(heartbeats(state, 4, 200), 1.0, 200, pause_s=120.0)
    assert hang.rank is None and 120 <= hang.value <= 125 and hang.baseline == 120.0
    assert "a declared eval pause, at most 120 s" in hang.message
    assert "the whole job paused: all 4 ranks in eval (4)" in hang.message


def saves(second_save_s: float, first_save_s: float = 60.0, between_s: float = 100.0) -> State:
    """Every rank trains, saves a checkpoint (declared) from 30 s for `first_save_s`, trains
    `between_s`, then saves again from there for `second_save_s` (inf: the save hangs)."""
    again_s = 30 + first_save_s + between_s

    def at(rank: int, t: float):
        if t < 30:
            return running(rank, t)
        if t < 30 + first_save_s:
            return 300, 299, "checkpoint"
        if t < again_s:
            return running(rank, t - first_save_s)
        if t < again_s + second_save_s:
            return 1300, 1299, "checkpoint"
        return running(rank, t - first_save_s - second_save_s)

    return at


def test_a_save_far_longer_than_the_runs_earlier_ones_is_a_hang_before_pause_s() -> None:
    # The first save took 60 s: a second that hangs is named after 3 x 60 s (the 300 s
    # floor here is lowered to 100 s), not after pause_s (1800 s), and says why.
    (hang,) = feed(heartbeats(saves(math.inf), 4, 600), 1.0, 600, pause_floor_s=100.0)
    assert hang.rank is None and 174 <= hang.value <= 186 and 174 <= hang.baseline <= 186
    assert "a declared checkpoint pause, 3x the longest this run came back from (" in (hang.message)
    assert "the whole job paused: all 4 ranks in checkpoint (4)" in hang.message
    # A second save as long as the first, or twice as long: no alert.
    assert feed(heartbeats(saves(60.0), 4, 600), 1.0, 600, pause_floor_s=100.0) == []
    assert feed(heartbeats(saves(120.0), 4, 600), 1.0, 600, pause_floor_s=100.0) == []


def test_a_fast_job_between_two_saves_too_briefly_for_a_heartbeat_still_learns() -> None:
    # A quarter of a second of training between the saves, between two heartbeats of every
    # rank (2 s apart): they say "checkpoint" throughout, but the steps they finished moved
    # on: the first save ended.
    beats = heartbeats(saves(math.inf, first_save_s=60.95, between_s=0.25), 4, 600)
    assert all(phase == "checkpoint" for t, _, (_, _, phase) in beats if 30 <= t < 400)
    (hang,) = feed(beats, 1.0, 600, pause_floor_s=100.0)
    assert 174 <= hang.baseline <= 186 and "3x the longest this run came back from" in (
        hang.message
    )


def test_a_learned_pause_threshold_keeps_its_floor_and_its_ceiling() -> None:
    # A 10 s first save: a hung second one waits for the floor (100 s), not 3 x 10 s; a
    # 300 s first save: 3 x 300 s is over pause_s (600 s here), which caps it.
    hang = feed(heartbeats(saves(math.inf, 10.0), 4, 600), 1.0, 600, pause_floor_s=100.0)
    assert [round(a.baseline) for a in hang] == [100]
    beats = heartbeats(saves(math.inf, 300.0), 4, 1500)
    (hang,) = feed(beats, 1.0, 1500, pause_floor_s=100.0, pause_s=600.0)
    assert hang.baseline == 600.0 and 600 <= hang.value <= 604


def test_an_evaluation_learns_nothing_from_the_runs_saves() -> None:
    # Saves of 60 s, then an evaluation that takes 400 s: a first pause of its phase gets
    # pause_s, whatever the saves took.
    def state(rank: int, t: float):
        base = saves(60.0)(rank, t) if t < 190 else running(rank, t - 60)
        if 190 <= t < 590:
            return 1300, 1299, "eval"
        return base if t < 590 else running(rank, t - 460)

    assert feed(heartbeats(state, 4, 700), 1.0, 700, pause_floor_s=100.0) == []


def test_a_pause_some_ranks_declared_while_the_others_wait_in_a_collective() -> None:
    # Rank 0 saves (declared); the others began step 300 and wait for it in a collective:
    # the job's pause. Others waiting in a barrier the loop did not declare: not a pause.
    def state(others: tuple[int, int, str]):
        def at(rank: int, t: float):
            if t < 30:
                return running(rank, t)
            return (299, 299, "checkpoint") if rank == 0 else others

        return at

    assert feed(heartbeats(state((300, 299, "collective")), 4, 120), 1.0, 120) == []
    (hang,) = feed(heartbeats(state((299, 299, "data_wait")), 4, 120), 1.0, 120)
    assert hang.rank is None and "checkpoint (1), data_wait (3)" in hang.message

    def rank_1_stuck(rank: int, t: float):  # a rank the others wait for, not in the pause
        if t < 30:
            return running(rank, t)
        return {0: (299, 299, "checkpoint"), 1: (299, 299, "data_wait")}.get(
            rank, (300, 299, "collective")
        )

    (hang,) = feed(heartbeats(rank_1_stuck, 4, 120), 1.0, 120)
    assert hang.rank == 0 and "rank 1 on node0 (step 299, data_wait)" in hang.message


def test_rank_lost_resolves_when_steps_complete_again() -> None:
    # rank 0's heartbeats stop for 20 s (a partition), then it is back and steps go on.
    def state(rank: int, t: float):
        if rank == 0 and 20 < t < 40:
            return None
        return running(rank, t)

    alerts = feed(heartbeats(state, 2, 60), 0.5, 60)
    assert kinds(alerts) == [("rank_lost", "critical", 0), ("rank_lost", "resolved", 0)]


def test_a_run_that_ended_never_alarms() -> None:
    def state(rank: int, t: float):
        if t > 50:
            return None
        return (500, 500, "ended") if t > 48 else running(rank, t)

    assert feed(heartbeats(state, 4, 200), 0.5, 200) == []


def test_a_run_resumed_after_its_end_is_watched_again() -> None:
    # Ended at 50 s (close() on every rank); resumed under the same run id at 100 s; rank 1
    # crashes at 150 s, the others are torn down at 152 s.
    def state(rank: int, t: float):
        if 50 < t < 100 or t > (150 if rank == 1 else 152):
            return None
        return (500, 500, "ended") if 48 < t <= 50 else running(rank, t)

    alerts = feed(heartbeats(state, 4, 200), 0.5, 200)
    assert kinds(alerts) == [("rank_lost", "critical", 1)]


def test_a_run_end_event_ends_the_run() -> None:
    beats = heartbeats(lambda r, t: running(r, t) if t < 50 else None, 2, 50)
    dog = Watchdog()
    for t, rank, (started, finished, phase) in beats:
        cols = {"rank": [rank], "time_unix_s": [t], "host": ["h"], "step_started": [started],
                "step_finished": [finished], "phase": [phase]}  # fmt: skip
        dog.observe(
            *heartbeats_to_arrow({"schema_version": 1, "run_id": "r", "heartbeats": cols}, t)
        )
    dog.end_run("r", 50.0)
    assert dog.advance(500) == []


def relaunched(crash_s: float | None = None):
    """A job of 4 ranks on 2 nodes that the supervisor stops at 60 s (the ranks say goodbye
    on its SIGTERM, within 0.5 s) and relaunches at 64 s on node0 alone, from a checkpoint
    300 steps back; its rank 1 crashes at `crash_s`, and rank 0 is torn down 2 s later."""

    def state(rank: int, t: float):
        if 60 < t < 64 or (t >= 64 and rank >= 2):
            return None
        if crash_s is not None and t > crash_s + (2 if rank == 0 else 0):  # rank 0 torn down
            return None
        return running(rank, t if t <= 60 else t - 30)

    beats = heartbeats(state, 4, 200) + [
        (60.1 + 0.1 * r, r, (600, 599, "exited")) for r in range(4)
    ]
    return sorted(beats)


@pytest.mark.parametrize("tick_s", [0.5, None])
@pytest.mark.parametrize("stop_s", [60.0, 59.5])  # 59.5: heartbeats sent before it come after
def test_a_supervisor_stop_and_relaunch_on_fewer_nodes_raises_nothing(tick_s, stop_s) -> None:
    # Without the stop, node1's ranks 2 and 3, never heard again, would be lost.
    assert kinds(feed(relaunched(), 0.5, 200)) == [
        ("rank_lost", "critical", 2),
        ("rank_lost", "resolved", 2),
    ]
    assert feed(relaunched(), tick_s, 200, stops=(stop_s,)) == []


def test_a_relaunch_slower_to_start_than_the_hang_floor_is_no_hang() -> None:
    # The relaunched processes load their checkpoint for 50 s ("idle", at the resume step)
    # before their first step: start-up, judged like a first step (first_step_s).
    def slow(rank: int, t: float):
        if 60 < t < 64 or (t >= 64 and rank >= 2):
            return None
        if 64 <= t < 114:
            return 299, 299, "idle"
        return running(rank, t if t <= 60 else t - 80)

    beats = sorted(
        heartbeats(slow, 4, 250) + [(60.1 + 0.1 * r, r, (600, 599, "exited")) for r in range(4)]
    )
    assert feed(beats, 0.5, 250, stops=(60.0,)) == []
    # A start-up longer than first_step_s is a hang, and said to be one.
    (hang, resolve) = feed(beats, 0.5, 250, stops=(60.0,), first_step_s=40.0)
    assert hang.time_unix_s == pytest.approx(64.3 + 40.0)  # the last relaunched, + first_step_s
    assert "40 s for a new process's first step" in hang.message and resolve.resolves


def test_a_crash_after_a_relaunch_is_named() -> None:
    alerts = feed(relaunched(crash_s=120.0), 0.5, 200, stops=(60.0,))
    assert kinds(alerts) == [("rank_lost", "critical", 1)]
    assert feed(relaunched(crash_s=120.0), None, 200, stops=(60.0,)) == alerts


def test_live_ticks_and_one_replay_pass_raise_the_same_alerts() -> None:
    def state(rank: int, t: float):
        if 30 <= t < 100:
            return (300, 299, "data_wait") if rank == 3 else (300, 299, "collective")
        if t > (150 if rank == 2 else 152):
            return None
        return running(rank, t if t < 30 else t - 70)

    beats = heartbeats(state, 4, 220)
    live = feed(beats, 0.7, 220)
    assert kinds(live) == [
        ("hang", "critical", 3),
        ("hang", "resolved", 3),
        ("rank_lost", "critical", 2),
    ]
    assert feed(beats, None, 220) == live


def test_the_typical_step_time_sets_the_hang_threshold() -> None:
    def state(rank: int, t: float):
        return running(rank, t) if t < 30 else (300, 299, "data_wait")

    (hang,) = feed(heartbeats(state, 2, 90), 1.0, 90, hang_floor_s=1.0, hang_intervals=50)
    assert hang.baseline == pytest.approx(50 * STEP_S, rel=0.2)


def test_a_fast_job_that_hangs_seconds_after_its_first_step_gets_a_steps_threshold() -> None:
    # 20 steps between two heartbeats of a rank: the few progress observations made by the
    # hang at 5 s (fewer than min_history=10 here) saw more than 20 steps, so the step time
    # is known and the hang is named at the 30 s floor, not after first_step_s (600 s).
    # Asked to see 1,000 steps first, it waits for 600 s.
    def state(rank: int, t: float):
        return running(rank, t) if t < 5 else (50, 49, "collective" if rank else "forward")

    (hang,) = feed(heartbeats(state, 2, 120), 1.0, 120, min_history=10)
    assert hang.rank == 0 and 30 <= hang.value <= 32 and hang.baseline == 30
    assert "10x the typical step time of" in hang.message
    beats = heartbeats(state, 2, 120)
    assert feed(beats, 1.0, 120, min_history=10, min_history_steps=1000) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("silence_s", 0),
        ("hang_floor_s", float("nan")),
        ("pause_s", -1),
        ("pause_intervals", 0),
        ("pause_floor_s", math.nan),
        ("window", 0),
        ("min_history", 1.5),
        ("min_history_steps", 0),
    ],
)
def test_bad_settings_are_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"liveness.{field} "):
        LivenessSettings(**{field: value})


def _table(rows: list[tuple[float, int, int]]):
    """Heartbeats of run r1: (receive time, rank, last finished step), phase forward."""
    cols = {
        "rank": [r for _, r, _ in rows],
        "time_unix_s": [t for t, _, _ in rows],
        "host": [f"node{r}" for _, r, _ in rows],
        "step_started": [f + 1 for _, _, f in rows],
        "step_finished": [f for _, _, f in rows],
        "phase": ["forward"] * len(rows),
    }
    table = heartbeats_to_arrow({"schema_version": 1, "run_id": "r1", "heartbeats": cols}, 0.0)[1]
    return table.set_column(
        table.schema.get_field_index("received_unix_s"),
        "received_unix_s",
        [[t for t, _, _ in rows]],
    )


def test_a_restored_open_episode_is_not_raised_again_and_resolves() -> None:
    # Before a collector restart at t=500: ranks 0-2 finished a step every 2 s until t=20;
    # rank 2 then went silent and was named (rank_lost, still open); ranks 0 and 1 went on
    # without progress until t=100. Restored, rank 2 stays lost without a second alert,
    # and the next completed step resolves the episode.
    live = Watchdog()
    rows = [(2.0 * k, r, k) for k in range(11) for r in range(3)]
    rows += [(20.0 + 2 * k, r, 10) for k in range(1, 41) for r in (0, 1)]
    live.observe("r1", _table(rows))
    (lost,) = live.advance(100.0)
    assert (lost.kind, lost.rank) == ("rank_lost", 2)

    dog = Watchdog()
    dog.restore("r1", _table(rows), now_s=500.0, last_alerts=[lost])
    dog.observe("r1", _table([(500.0 + 2 * k, r, 10) for k in range(1, 6) for r in (0, 1)]))
    assert dog.advance(510.0) == []  # rank 2 is not named again; 0 and 1 are heard
    dog.observe("r1", _table([(512.0, 0, 11), (512.0, 1, 11)]))
    (resolved,) = dog.advance(513.0)
    assert resolved.resolves and (resolved.kind, resolved.rank) == ("rank_lost", 2)


@pytest.mark.parametrize(("last_finished", "resolved_at"), [(399, 401), (700, 701)])
def test_a_run_end_resolves_rank_lost_after_its_step(last_finished, resolved_at) -> None:
    # rank 1 goes silent at 40 s; rank 0's heartbeats show no finished step after 399 (a
    # restart in progress) until it closes its monitor at 59 s, its last heartbeat showing
    # step `last_finished`. The store keys alerts by (run, kind, step): a resolve at the
    # open's step 400 would be lost live, not in replay. The ended heartbeat's own step
    # counts (the job may run on to step 700 between two heartbeats).
    def state(rank: int, t: float):
        if rank == 1 and t > 40:
            return None
        if rank == 0 and t >= 59:
            return (last_finished, last_finished, "ended")
        return (400, 399, "forward") if t > 40 else running(rank, t)

    lost, resolved = feed(heartbeats(state, 2, 62), 0.5, 62)
    assert kinds([lost, resolved]) == [("rank_lost", "critical", 1), ("rank_lost", "resolved", 1)]
    assert (lost.step, resolved.step, resolved.start_step) == (400, resolved_at, 400)
    assert "rank 0 closed its monitor: the run ended" in resolved.message


def test_a_restored_run_raises_no_row_on_its_last_rows_step() -> None:
    # Before the restart a rank_lost at step 11 was resolved at step 12 (the last stored
    # row). Restored at t=500, rank 1 goes silent with the job still at step 11: the new
    # rank_lost comes after step 12, not on it (the store would drop it).
    rows = [(2.0 * k, r, k) for k in range(11) for r in range(2)]
    open_row = Alert("r1", 11, "rank_lost", "critical", "m", 30.0, rank=1)
    resolve_row = open_row.resolved_at(12, 40.0, "step 11 completed: progress resumed")
    dog = Watchdog()
    dog.restore("r1", _table(rows), now_s=500.0, last_alerts=[resolve_row])
    dog.observe("r1", _table([(500.0 + 2 * k, 0, 10) for k in range(1, 10)]))
    (lost,) = dog.advance(520.0)
    assert (lost.kind, lost.rank, lost.step) == ("rank_lost", 1, 13)
