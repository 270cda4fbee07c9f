"""A collector that is not there is reported as such, not as a rejection."""

from __future__ import annotations

from trainvitals.sender import send

from .collector.conftest import make_batch
from .conftest import free_port


def test_refused_connections_are_not_delivered_not_rejected() -> None:
    """`simulate` said "1 rejected" when nothing listened: the collector never said no."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    report = send([make_batch().to_dict()], url, connections=1, attempts=2)
    assert report.rejected == []
    assert len(report.undelivered) == 1 and "onnect" in report.undelivered[0]
    assert report.summary().endswith("0 rejected, 1 not delivered")
