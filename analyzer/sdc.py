"""Silent data corruption: a rank whose canary fingerprint disagrees with the majority.

Every rank runs the same fixed computation on a canary step and reports a fingerprint of
the result's bits (hooks/canary.py). Healthy identical devices agree bit for bit, so a
strict majority names the faulty ranks. With two ranks, or no majority, the disagreement
is reported without a culprit. A rank is named once; it is named again only after it has
agreed with the majority once more (a transient fault that came back).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .alerts import Alert
from .detectors import StepView


@dataclass
class CanaryDetector:
    kind: str = "sdc"
    _named: set = field(default_factory=set, repr=False)

    def observe(self, s: StepView) -> list[Alert]:
        if s.ranks is None:
            return []
        prints = {r: fp for r, fp in enumerate(s.ranks.canary_fingerprint) if fp is not None}
        if len(prints) < 2:
            return []
        (majority, votes), *_ = Counter(prints.values()).most_common(1)
        if votes == len(prints):
            self._named.clear()
            return []
        if 2 * votes <= len(prints):  # no strict majority: something is wrong, nobody named
            return [self._alert(s, None, len(prints) - votes, len(prints))]
        wrong = sorted(r for r, fp in prints.items() if fp != majority)
        self._named &= set(wrong)
        alerts = [self._alert(s, r, len(wrong), len(prints)) for r in wrong if r not in self._named]
        self._named.update(wrong)
        return alerts

    def _alert(self, s: StepView, rank: int | None, n_wrong: int, n_ranks: int) -> Alert:
        who = f"rank {rank}'s" if rank is not None else "the ranks'"
        return Alert(
            run_id=s.run_id,
            step=s.step,
            kind=self.kind,
            severity="critical",
            message=(
                f"{who} SDC canary fingerprint disagrees with the majority at step {s.step} "
                f"({n_wrong} of {n_ranks} ranks differ): its device computes wrong numbers; "
                "drain the node and rerun the steps since its last agreeing canary"
            ),
            time_unix_s=s.time_unix_s,
            rank=rank,
        )
