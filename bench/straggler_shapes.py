"""Stragglers of shapes the straggler detector was not built around, on real runs.

The detector was tuned on stragglers that start at one step and stay (bench/detect.py).
Here the reference trainer (4 CPU ranks, dp 2 x tp 2, every step logged, 8 busy
processes on the machine's cores unless said) meets others:
- on-off: one rank 25% slower for 60 steps, three times, with 60 steps between;
- ramp: one rank slowing from 0 to 30% over 200 steps (a part wearing out, a clock
  drifting down), then staying so;
- two at once: two of the four ranks 25% slower from the same step;
- idle: one rank asleep in its forward for twice its compute time (`how=idle`, as under a
  CPU quota), dp 4 and dp 2 x tp 2 (whose tensor-parallel collectives the hooks time on
  gloo where they wait for them, since 2026-11-29);
- data: one rank waiting for its batches as long as it computes (`how=data`: a slow
  file system), dp 2 x tp 2 and dp 4;
- hiccups: one rank waiting 10x its compute time for one batch in 25 (`every=25`: a shared
  file system's bad moments), and one computing that much more one step in 25 (a
  collector pause, a page-fault storm), dp 2 x tp 2 and dp 4: 4% of the steps, but
  about a tenth of the run's time; and smaller ones, 3x its compute time one batch in 10;
  and the big ones logged every 10 steps, as the hooks do by default;
- 8 ranks (dp 4 x tp 2) with a 15% straggler, loaded;
- no straggler at all: two clean loaded 1,000-step runs at dp 4, and a clean run that
  saves a checkpoint every 25 steps (each save a slow step of every rank).

Each episode is expected to raise a straggler (or intermittent_straggler) alert naming
its rank(s) within
`WITHIN_STEPS` of its start (the restless window's 60 steps plus 20; a ramp, whenever it
is named), and a resolve after it ends (where it ends); every other alert is counted as
false. Most shapes run twice: loaded, and with no load added ("quiet-"). The telemetry files are
kept in --real-dir and reused. The last line is the headline.

    python bench/straggler_shapes.py [--only NAME,...] [--real-dir DIR] [--set S.F=V] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import orjson
from detect import RealRun, train  # bench/, run as a script

from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.alerts import Alert
from trainvitals.analyzer.config import AnalyzerConfig
from trainvitals.schema import to_arrow

STRAGGLER_KINDS = ("straggler", "intermittent_straggler")  # either names an episode
WITHIN_STEPS = 80  # an episode is named in time when its alert comes this soon after it began
RESOLVE_STEPS = 100  # ... and resolved in time when the resolve comes this soon after it ended


@dataclass(frozen=True)
class Episode:
    ranks: tuple[int, ...]
    first: int
    end: int | None  # the first step no longer slowed; None: the run's end
    within: int = WITHIN_STEPS  # steps after `first` in which it must be named


@dataclass(frozen=True)
class Shape:
    run: RealRun
    episodes: tuple[Episode, ...]
    note: str


def _on_off(loaded: bool, how: str = "busy") -> Shape:
    """Rank 1 25% slower for 60 steps, three times, 60 steps apart (`how=data`: waiting
    its whole compute time for its data instead, about 20% of a step)."""
    starts, length = (40, 160, 280), 60
    slowdown = 1 if how == "data" else 0.25
    injects = tuple(
        f"straggler:rank=1,step={s},slowdown={slowdown},until={s + length},how={how}"
        for s in starts
    )
    episodes = tuple(Episode((1,), s, s + length) for s in starts)
    note = "on and off" + (", waiting for data" if how == "data" else "")
    return Shape(RealRun(injects, starts[-1] + length + 60, loaded), episodes, note)


def _ramp(loaded: bool) -> Shape:
    """Rank 2 slowing from 0 to 30% over steps 50-249: named whenever it is, the latency
    counted from the ramp's start (it is 10% slower at step 116, 20% at 182)."""
    run = RealRun(("straggler:rank=2,step=50,slowdown=0.3,ramp=200",), 350, loaded)
    return Shape(run, (Episode((2,), 50, None, within=300),), "0 to 30% over steps 50-249")


def _two(loaded: bool) -> Shape:
    injects = tuple(f"straggler:rank={r},step=40,slowdown=0.25" for r in (1, 2))
    return Shape(RealRun(injects, 160, loaded), (Episode((1, 2), 40, None),), "ranks 1 and 2")


def _idle(loaded: bool) -> Shape:
    """Rank 3 asleep in its forward for twice its compute time, dp 4 without tensor
    parallelism: on gloo every collective the others wait for it in is timed."""
    run = RealRun(("straggler:rank=3,step=40,slowdown=2,how=idle",), 160, loaded,
                  extra=("--dp", "4", "--tp", "1"))  # fmt: skip
    return Shape(run, (Episode((3,), 40, None),), "asleep twice its compute time, dp 4")


def _data(loaded: bool, dp4: bool) -> Shape:
    """Rank 2 waiting for its batches as long as it computes (`how=data`: a slow file
    system or a starved loader on its node), from step 40: off the CPU, before the
    forward, so the others wait for it in the forward's collectives."""
    extra = ("--dp", "4", "--tp", "1") if dp4 else ()
    run = RealRun(("straggler:rank=2,step=40,slowdown=1,how=data",), 160, loaded, extra=extra)
    note = f"waits its compute time for data, {'dp 4' if dp4 else 'dp 2 x tp 2'}"
    return Shape(run, (Episode((2,), 40, None),), note)


def _hiccups(loaded: bool, how: str, dp4: bool = False) -> Shape:
    """Rank 2 held back 10x its compute time one step in 25 from step 40, for 260 steps:
    each hiccup costs the job about 2.5 steps' time (a tenth of the run), yet no 25-step
    window holds more than two slow steps. To be named once 3 have come (step 90)."""
    extra = ("--dp", "4", "--tp", "1") if dp4 else ()
    run = RealRun((f"straggler:rank=2,step=40,slowdown=10,every=25,how={how}",), 300, loaded,
                  extra=extra)  # fmt: skip
    what = "waits 10x its compute for one batch" if how == "data" else "computes 10x more one step"
    note = f"{what} in 25, {'dp 4' if dp4 else 'dp 2 x tp 2'}"
    return Shape(run, (Episode((2,), 40, None, within=2 * 25 + WITHIN_STEPS),), note)


def _hiccups_every10(loaded: bool, how: str, every: int = 25) -> Shape:
    """The same hiccups, logged every 10 steps (the hooks' default): between logged steps
    they show only in the steps' time (their time_unix_s) and in the ranks' means over
    them. From step 250: the detector knows the typical step after 20 logged steps. One
    in 25 lands on a logged step every other time (steps 250, 300...); one in 27 on one
    in 10 (steps 250, 520...)."""
    run = RealRun((f"straggler:rank=2,step=250,slowdown=10,every={every},how={how}",), 500,
                  loaded, extra=("--log-every", "10"))  # fmt: skip
    what = "waits 10x its compute for one batch" if how == "data" else "computes 10x more one step"
    note = f"{what} in {every}, logged every 10 steps, dp 2 x tp 2"
    # Named once they cost 3% of the window's time: from step 250 the window holds 250
    # clean steps too, so at about 9% of the time from then on that takes 100-150 steps
    # (from step 40, as above, 50).
    return Shape(run, (Episode((2,), 250, None, within=200),), note)


def _small_hiccups(loaded: bool) -> Shape:
    """Rank 1 waiting 3x its compute time for one batch in 10 from step 40: each wait
    under a step's length (the step about 1.8x), about 7% of the run's time."""
    run = RealRun(("straggler:rank=1,step=40,slowdown=3,every=10,how=data",), 200, loaded)
    note = "waits 3x its compute for one batch in 10, dp 2 x tp 2"
    return Shape(run, (Episode((1,), 40, None, within=2 * 10 + WITHIN_STEPS),), note)


def _small_hiccups_every10() -> Shape:
    """The small ones logged every 10 steps, quiet: one wait in every logged interval, so
    every interval is slow by the same rank (one long hiccup to the intermittent
    detector); the straggler detector's data signal, on the means, should name it."""
    run = RealRun(("straggler:rank=1,step=250,slowdown=3,every=10,how=data",), 500, False,
                  extra=("--log-every", "10"))  # fmt: skip
    note = "waits 3x its compute for one batch in 10, logged every 10 steps, dp 2 x tp 2"
    return Shape(run, (Episode((1,), 250, None),), note)


def _clean(seed: str) -> Shape:
    """No straggler, dp 4: every collective is timed, so the arrival signal holds the most;
    loaded, 1,000 steps. Every alert is false."""
    run = RealRun(steps=1000, extra=("--dp", "4", "--tp", "1", "--seed", seed))
    return Shape(run, (), "no straggler, dp 4")


def _checkpoints(loaded: bool, log_every: int = 1) -> Shape:
    """No straggler; a sharded checkpoint saved every 25 steps (into a temporary folder),
    each save a slow step. Every alert is false. Logged every 10 steps, 500 of them: the
    saves fall between logged steps, in the steps' time and every rank's data-time mean."""
    folder = Path(tempfile.gettempdir()) / "trainvitals-shapes-checkpoints"
    run = RealRun(steps=300 if log_every == 1 else 500, loaded=loaded, extra=(
        "--checkpoint-dir", str(folder), "--checkpoint-every", "25",
        "--log-every", str(log_every),
    ))  # fmt: skip
    logged = "" if log_every == 1 else f", logged every {log_every} steps"
    return Shape(run, (), f"a checkpoint every 25 steps{logged}, dp 2 x tp 2")


SHAPES = {
    "on-off25": _on_off(True),
    "quiet-on-off25": _on_off(False),
    "ramp30": _ramp(True),
    "quiet-ramp30": _ramp(False),
    "two25": _two(True),
    "quiet-two25": _two(False),
    "idle-dp4": _idle(True),
    "quiet-idle-dp4": _idle(False),
    "idle": Shape(
        RealRun(("straggler:rank=3,step=40,slowdown=2,how=idle",), steps=160),
        (Episode((3,), 40, None),),
        "asleep twice its compute time, dp 2 x tp 2",
    ),
    "quiet-idle": Shape(
        RealRun(("straggler:rank=3,step=40,slowdown=2,how=idle",), steps=160, loaded=False),
        (Episode((3,), 40, None),),
        "asleep twice its compute time, dp 2 x tp 2",
    ),
    "data": _data(True, False),
    "quiet-data": _data(False, False),
    "data-dp4": _data(True, True),
    "quiet-data-on-off": _on_off(False, "data"),
    "quiet-data-dp4": _data(False, True),
    "hiccup-data": _hiccups(True, "data"),
    "quiet-hiccup-data": _hiccups(False, "data"),
    "quiet-hiccup-data-dp4": _hiccups(False, "data", dp4=True),
    "hiccup-busy": _hiccups(True, "busy"),
    "quiet-hiccup-busy": _hiccups(False, "busy"),
    "hiccup-8rank": Shape(
        RealRun(("straggler:rank=5,step=40,slowdown=10,every=25,how=data",), 300, nproc=8),
        (Episode((5,), 40, None, within=2 * 25 + WITHIN_STEPS),),
        "waits 10x its compute for one batch in 25, 8 ranks, dp 4 x tp 2",
    ),
    "quiet-hiccup-data-every10": _hiccups_every10(False, "data"),
    "hiccup-data-every10": _hiccups_every10(True, "data"),
    "hiccup-busy-every10": _hiccups_every10(True, "busy"),
    "quiet-hiccup-data-every10-in27": _hiccups_every10(False, "data", every=27),
    "hiccup-data-every10-in27": _hiccups_every10(True, "data", every=27),
    "quiet-hiccup-small-every10": _small_hiccups_every10(),
    "hiccup-small": _small_hiccups(True),
    "quiet-hiccup-small": _small_hiccups(False),
    "checkpoints": _checkpoints(True),
    "quiet-checkpoints-every10": _checkpoints(False, log_every=10),
    "checkpoints-every10": _checkpoints(True, log_every=10),
    "quiet-checkpoints": _checkpoints(False),
    "clean-dp4-a": _clean("7"),
    "clean-dp4-b": _clean("8"),
    "8rank15": Shape(
        RealRun(("straggler:rank=5,step=30,slowdown=0.15",), steps=120, nproc=8),
        (Episode((5,), 30, None),),
        "8 ranks, dp 4 x tp 2",
    ),
}


def alerts_of(path: Path, config: AnalyzerConfig) -> list[Alert]:
    analyzer, out = Analyzer(config=config), []
    for line in path.read_bytes().splitlines():
        run_id, tables = to_arrow(orjson.loads(line))
        out += analyzer.observe(run_id, tables)
    return out


def named_ranks(alert: Alert) -> set[int]:
    """The ranks a straggler alert names: its own and those after "also" (an intermittent
    straggler's alert names one)."""
    if alert.kind == "intermittent_straggler":
        return {alert.rank} if alert.rank is not None else set()
    head = alert.message.split(" since step")[0]
    return {int(r) for r in re.findall(r"rank (\d+)", head)}


def judge(name: str, shape: Shape, alerts: list[Alert]) -> tuple[list[str], int, int, list[int]]:
    """Lines of the report, episodes named in time, false alerts, latencies."""
    raised = [a for a in alerts if a.severity != "resolved"]
    resolves = [a for a in alerts if a.severity == "resolved"]
    used: set[int] = set()
    lines, named, latencies = [], 0, []
    for ep in shape.episodes:
        hits = [
            a for a in raised
            if a.kind in STRAGGLER_KINDS and ep.first <= a.step <= ep.first + ep.within
            and named_ranks(a) & set(ep.ranks)
        ]  # fmt: skip
        got = set().union(*(named_ranks(a) for a in hits)) & set(ep.ranks)
        used |= {id(a) for a in hits}
        span = f"steps {ep.first}-{'end' if ep.end is None else ep.end - 1}"
        if got != set(ep.ranks):
            lines.append(f"    ranks {list(ep.ranks)} {span}: named {sorted(got) or 'none'}")
            continue
        named += 1
        latencies.append(hits[0].step - ep.first)
        resolved = ""
        if ep.end is not None:
            late = [r.step for r in resolves if ep.end <= r.step <= ep.end + RESOLVE_STEPS]
            resolved = f", resolved at {late[0]}" if late else ", NOT resolved in time"
        lines.append(
            f"    ranks {list(ep.ranks)} {span}: named at step {hits[0].step} "
            f"(onset {hits[0].start_step}, +{hits[0].step - ep.first}){resolved}: "
            f"{hits[0].message[:160]}"
        )
    false = [a for a in raised if id(a) not in used]
    for a in false:
        lines.append(f"    FALSE {a.kind} at step {a.step}: {a.message[:160]}")
    head = (
        f"{name} ({shape.note}; {shape.run.nproc} ranks, {shape.run.steps} steps, "
        f"{'loaded' if shape.run.loaded else 'no load added'}): {named}/{len(shape.episodes)} "
        f"episodes named in time, {len(false)} false alerts"
    )
    return [head, *lines], named, len(false), latencies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help=f"comma-separated among {','.join(SHAPES)}")
    p.add_argument(
        "--real-dir", default=str(Path(tempfile.gettempdir()) / "trainvitals-shapes"),
        help="telemetry files of the runs (made once, then reused)",
    )  # fmt: skip
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="a detector setting other than its default (analyzer/config.py)",
    )  # fmt: skip
    p.add_argument("--out", help="also write the report here")
    args = p.parse_args()
    try:
        config = AnalyzerConfig.load(overrides=args.set)
    except ValueError as e:
        p.error(str(e))
    names = args.only.split(",") if args.only else list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        p.error(f"--only: no shape {unknown[0]!r} (shapes: {', '.join(SHAPES)})")
    out_dir = Path(args.real_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "$ python bench/straggler_shapes.py " + " ".join(sys.argv[1:]),
        f"# {os.cpu_count()} cores, 1-min load average {os.getloadavg()[0]:.1f} at the start",
    ]
    episodes = named = false = 0
    latencies: list[int] = []
    for name in names:
        shape = SHAPES[name]
        path = out_dir / f"{name}.jsonl"
        note = train(name, shape.run, path) if not path.exists() else f"reused {path}"
        report, n, f, lat = judge(name, shape, alerts_of(path, config))
        lines += [report[0] + f" ({note})", *report[1:]]
        episodes += len(shape.episodes)
        named, false, latencies = named + n, false + f, latencies + lat
    median = f"{statistics.median(latencies):.0f}" if latencies else "n/a"
    lines.append(
        f"straggler shapes: {named}/{episodes} episodes named in time, "
        f"{false} false alerts, median latency {median} steps"
    )
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
