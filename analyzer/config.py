"""One analyzer configuration: every detector's settings, apart from its running state.

Each section is the frozen settings dataclass of one detector, defined beside the detector
with its defaults documented there (DESIGN invariant 11). The collector, `replay` and
`analyze` accept the same configuration; later sources override earlier ones, field by
field:

1. the defaults;
2. a file, TOML or JSON (`--analyzer-config FILE`; the collector also reads
   TRAINVITALS_ANALYZER_CONFIG):

       [straggler]
       persist_steps = 20
       [liveness]
       silence_s = 15

3. environment variables TRAINVITALS_ANALYZER__<SECTION>__<FIELD> (collector only: a
   replay or an analysis of a file should not change with the shell it runs in);
4. `--set SECTION.FIELD=VALUE` flags.

`trainvitals config` prints the configuration in force, as a file to start from.
A replay must use the configuration the collector ran with to reproduce its alerts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .attribution import LayerAttributionSettings
from .detectors import LossSpikeSettings, NonFiniteSettings
from .divergence import DivergenceSettings
from .intermittent import IntermittentSettings
from .liveness import LivenessSettings
from .replica import ReplicaSettings
from .sdc import CanarySettings, PeerOutlierSettings
from .settings_io import as_dict, build, merged, read_env, read_file, read_overrides
from .stall import StallSettings
from .straggler import StragglerSettings
from .throttle import ThrottleSettings
from .throughput import ThroughputSettings


@dataclass(frozen=True)
class AnalyzerConfig:
    """Settings of every detector, one section each (see each class for its fields)."""

    nonfinite: NonFiniteSettings = field(default_factory=NonFiniteSettings)
    loss_spike: LossSpikeSettings = field(default_factory=LossSpikeSettings)
    layer_attribution: LayerAttributionSettings = field(default_factory=LayerAttributionSettings)
    divergence: DivergenceSettings = field(default_factory=DivergenceSettings)
    straggler: StragglerSettings = field(default_factory=StragglerSettings)
    intermittent: IntermittentSettings = field(default_factory=IntermittentSettings)
    canary: CanarySettings = field(default_factory=CanarySettings)
    replica: ReplicaSettings = field(default_factory=ReplicaSettings)
    peer_outlier: PeerOutlierSettings = field(default_factory=PeerOutlierSettings)
    stall: StallSettings = field(default_factory=StallSettings)
    throttle: ThrottleSettings = field(default_factory=ThrottleSettings)
    throughput: ThroughputSettings = field(default_factory=ThroughputSettings)
    liveness: LivenessSettings = field(default_factory=LivenessSettings)

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        overrides: list[str] = (),  # type: ignore[assignment]
        environ: Mapping[str, str] | None = None,
    ) -> AnalyzerConfig:
        """Defaults, then the file at `path`, then `environ`'s variables, then `overrides`.

        ValueError, naming the section, field and source, on anything it cannot use.
        """
        sources = [
            (read_file(path) if path else {}, f"analyzer config {str(path)!r}"),
            (read_env(environ or {}), "environment"),
            (read_overrides(list(overrides)), "--set"),
        ]
        sections = [f.name for f in fields(cls)]
        for values, source in sources:
            unknown = sorted(set(values) - set(sections))
            if unknown:
                raise ValueError(
                    f"{source}: no detector section {unknown[0]!r} (sections: "
                    f"{', '.join(sections)})"
                )
        given = merged(*(values for values, _ in sources))
        defaults = cls()
        settings = {}
        for name in sections:
            default = getattr(defaults, name)
            if name not in given:
                settings[name] = default
                continue
            where = " / ".join(source for values, source in sources if name in values)
            settings[name] = build(type(default), name, given[name], where)
        return cls(**settings)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: as_dict(getattr(self, f.name)) for f in fields(self)}

    def to_toml(self) -> str:
        """The configuration as a TOML file that `load` reads back."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
            lines.append("")
        return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float) and v == float("inf"):
        return "inf"
    return repr(v)
