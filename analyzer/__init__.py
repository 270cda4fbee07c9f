"""Detectors of loss spikes, non-finite values (and, later, stragglers and SDC)."""

from .alerts import Alert
from .engine import Analyzer

__all__ = ["Alert", "Analyzer"]
