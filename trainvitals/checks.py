"""Checks of user input shared by the CLI and the configs.

Each returns the value when it is good and raises ValueError naming `name` when it is not,
so that a command can refuse bad input with one line before it starts anything.
"""

from __future__ import annotations

import math


def positive(name: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def non_negative(name: str, value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return value


def http_url(name: str, url: str) -> str:
    """An http(s) URL with a host, parsed the way the senders (httpx) will parse it."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ValueError(f"{name} {url!r} is not a valid URL: {e}") from None
    if (parsed.port or 0) > 65535:
        raise ValueError(f"{name} {url!r} is not a valid URL: port {parsed.port} > 65535")
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{name} must be an http(s) URL such as http://host:8000, got {url!r}")
    return url
