"""Where the analyzer's telemetry comes from, and the one loop that feeds it to the detectors.

A telemetry source hands out windows of steps, per run and in step order: the run's
`runs` row (when known) and its steps, layers, ranks and events rows of those steps, the
tables `Analyzer.observe` takes. Two sources, one per driver (DESIGN invariant 3):
- `LiveTelemetry` (live.py): rows the collector's store has committed, buffered in memory
  and handed out a moment after their commit;
- `StoredTelemetry` (replay.py): a stored run, read back from a store or an export.

Both drivers run `analyze` over their source, so the same windows raise the same alerts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from .alerts import Alert
from .engine import Analyzer

# (run_id, table name -> Arrow table) of one window of steps
Window = tuple[str, dict[str, Any]]


class TelemetrySource(Protocol):
    def windows(self) -> Iterable[Window]:
        """The windows ready for analysis now, each run's in step order."""
        ...


def analyze(
    source: TelemetrySource,
    analyzer: Analyzer,
    on_error: Callable[[str, Exception], None] | None = None,
) -> Iterator[Alert]:
    """Every alert `analyzer` raises over the windows of `source`, in their order.

    on_error: called with the run and the error when a window fails, and the next window
    goes on (the live driver counts it); None raises it.
    """
    for run_id, tables in source.windows():
        try:
            alerts = analyzer.observe(run_id, tables)
        except Exception as e:
            if on_error is None:
                raise
            on_error(run_id, e)
            continue
        yield from alerts
