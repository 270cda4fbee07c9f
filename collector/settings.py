"""Collector settings: one class, every field overridable by a TRAINVITALS_* env var."""

from __future__ import annotations

import os

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainvitals.analyzer.config import AnalyzerConfig

from .memory import DEFAULT_MEMORY_LIMIT, memory_limit_bytes


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINVITALS_")

    store_path: str = Field("trainvitals.duckdb", description="DuckDB file the collector owns")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    replay: bool = Field(False, description="serve a stored run read-only; ingest is refused")
    ingest_token: str = Field(
        "",
        description="if set, writes (ingest, OTLP, heartbeats) require 'Authorization: Bearer "
        "<token>', and so do reads unless read_token is set",
    )
    read_token: str = Field(
        "",
        description="if set, reads (query API, /metrics, /docs, /openapi.json) require "
        "'Authorization: Bearer <token>' with this token; /healthz and /readyz stay open",
    )
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0, description="largest accepted ingest body")
    max_decoding_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="bytes of request bodies read or decoded at once, all requests together; "
        "beyond: 503 with Retry-After (collector/limits.py). At least max_body_bytes",
    )
    decode_workers: int = Field(
        1,
        ge=0,
        description="processes that decode large bodies, so that decoding never holds the "
        "event loop (collector/decoding.py); 0: every body is decoded in a thread",
    )
    decode_in_process_bytes: int = Field(
        512 * 1024,
        ge=0,
        description="bodies smaller than this (after gzip) are decoded in a thread, not a "
        "worker process: the hand-off would cost more",
    )
    gc_max_objects: int = Field(
        50_000,
        ge=0,
        description="objects the garbage collector's oldest generation gathers before the "
        "collector collects and freezes them, keeping its pauses short (collector/gcguard.py); "
        "0: CPython's own full collections, whose pauses grow with the collector's state",
    )
    retention_days: float = Field(
        0,
        ge=0,
        allow_inf_nan=False,  # NaN would fail `ge` with a message that hides the cause
        description="drop runs whose last step is older than this; 0 keeps every run",
    )
    memory_limit: str = Field(
        DEFAULT_MEMORY_LIMIT, description="most memory DuckDB may use, e.g. 2GB or 512MiB"
    )
    max_metrics_runs: int = Field(
        200,
        ge=0,
        description="runs with series in /metrics at most, those with the latest steps (running "
        "ones first); 0: every stored run. About 9 series a run",
    )
    queue_max_batches: int = Field(
        1024, gt=0, description="batches waiting for the writer; beyond: 503"
    )
    analyzer_config: str = Field(
        "", description="detector settings file, TOML or JSON (analyzer/config.py)"
    )
    # `--set SECTION.FIELD=VALUE` flags; single settings also come from
    # TRAINVITALS_ANALYZER__<SECTION>__<FIELD> variables, read by analyzer().
    analyzer_set: list[str] = Field(default_factory=list, exclude=True)

    def analyzer(self) -> AnalyzerConfig:
        """The detector settings: the file, then TRAINVITALS_ANALYZER__* variables, then --set.
        ValueError naming the setting and its source."""
        return AnalyzerConfig.load(self.analyzer_config or None, self.analyzer_set, os.environ)

    @field_validator("store_path")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        if not v:
            raise ValueError("store_path must not be empty")
        return v

    @field_validator("ingest_token", "read_token")
    @classmethod
    def _no_spaces_around(cls, v: str, info) -> str:
        if v != v.strip():
            # "Bearer <token>" is split on spaces: such a token could never match.
            raise ValueError(
                f"{info.field_name} has leading or trailing spaces, so no request could ever "
                "match it; remove them"
            )
        return v

    @property
    def reader_token(self) -> str:
        """The token reads need: the read token, else the ingest token ('' for none)."""
        return self.read_token or self.ingest_token

    @model_validator(mode="after")
    def _budget_holds_a_body(self) -> Settings:
        if self.max_decoding_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_decoding_bytes ({self.max_decoding_bytes}) must be at least "
                f"max_body_bytes ({self.max_body_bytes}), or a body of the largest size "
                "could never be decoded"
            )
        return self

    @field_validator("memory_limit")
    @classmethod
    def _a_size(cls, v: str) -> str:
        memory_limit_bytes(v)
        return v
