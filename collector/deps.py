"""Shared FastAPI dependencies. Tests swap them through app.dependency_overrides."""

from __future__ import annotations

from fastapi import Request

from trainvitals.analyzer.live import LiveAnalysis

from .decoding import Decoder
from .settings import Settings
from .state import LiveState
from .store import Store
from .watchdog import LiveWatchdog


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_store(request: Request) -> Store:
    return request.app.state.store


def get_live(request: Request) -> LiveState:
    """Each run's latest values and the collector's counts, for /metrics (state.py)."""
    return request.app.state.live


def get_watchdog(request: Request) -> LiveWatchdog | None:
    """The liveness watchdog; None in replay mode."""
    return getattr(request.app.state, "watchdog", None)


def get_analysis(request: Request) -> LiveAnalysis | None:
    """The live analysis behind the writer; None in replay mode."""
    return getattr(request.app.state, "analysis", None)


def get_decoder(request: Request) -> Decoder:
    """Where bodies are decoded: large ones in a worker process (decoding.py)."""
    return request.app.state.decoder
