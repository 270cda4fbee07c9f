"""The monitor's settings: one dataclass, validated on construction (attach's keywords)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainvitals.schema import LOSS_SCALING, check_run_id


@dataclass
class MonitorConfig:
    """Settings of a monitor. Every field has a default that suits a first run."""

    run_id: str = ""  # empty: a fresh id, agreed by all ranks
    # Steps between logged steps. A logged step costs several unlogged ones: per-layer norms
    # of every gradient, parameter and output, the parameter copy behind update RMS, and
    # two all-reduces (bench/hook_overhead.py measures both intervals).
    log_every: int = 10
    export_interval_s: float = 1.0  # each exporting rank sends a batch at most this often
    queue_size: int = 1024  # logged steps waiting for export; more are counted and dropped
    flops_per_token: float | None = None  # None: counted over the first step (flops.StepFlops)
    peak_flops_per_s: float | None = None  # None: from the device table or measured on CPU
    peak_precision: str = "bf16"  # which column of the peak table: "bf16" or "fp8"
    token_target: int | None = None  # tokens the run means to train on (for time-to-target)
    model_name: str = ""
    model_config: dict[str, Any] = field(default_factory=dict)
    # Mesh dims along which a block's plain-tensor output is identical (see layers.py).
    activation_replicated_dims: tuple[str, ...] = ("tp",)
    # Steps between SDC canary fingerprints, taken on the first logged step at or after
    # each multiple of it (every rank alike); 0: off.
    canary_every: int = 50
    canary_dtype: str = ""  # "": bfloat16 on CUDA, float32 elsewhere (the usual training dtype)
    power_interval_s: float = 0.1  # power sampling period; 0: no power sampling
    # The stopped clock's period on CPU ranks (hooks/stopped.py: time the process was
    # stopped, for the straggler detector); 0: off. Its thread costs about 0.8% of a core.
    stopped_interval_s: float = 0.01
    first_step: int = 0  # a resumed run counts on from where its checkpoint left off
    # Steps the run trains for, counted from 0 like first_step (None: not known). Its last
    # step is then logged whatever the interval, so that the maxima and non-finite counts of
    # the steps after the last interval reach the collector too.
    total_steps: int | None = None
    # Time NCCL collectives with CUDA events (one pair per collective; docs/interconnect.md).
    # None: only if TORCH_NCCL_ENABLE_TIMING=1 is set.
    time_collectives: bool | None = None
    # Collector that receives this rank's heartbeats (every rank sends its own; "": none,
    # unless attach() was given a collector_url), and how often, in seconds (hooks/heartbeat.py).
    heartbeat_url: str = ""
    heartbeat_interval_s: float = 2.0
    # "dynamic": gradients are scaled by a dynamic loss scaler (torch.amp.GradScaler, fp16),
    # which overflows now and then by design and skips those steps: the analyzer then takes
    # a logged step whose only non-finite values are gradients for such an overflow.
    loss_scaling: str = "none"

    def __post_init__(self) -> None:
        if self.run_id:  # refused now: the collector would refuse every batch of the run
            check_run_id(self.run_id)
        if self.log_every < 1:
            raise ValueError(f"MonitorConfig.log_every must be >= 1, got {self.log_every}")
        if self.export_interval_s <= 0:
            raise ValueError("MonitorConfig.export_interval_s must be > 0")
        if self.queue_size < 1:
            raise ValueError("MonitorConfig.queue_size must be >= 1")
        if self.flops_per_token is not None and self.flops_per_token <= 0:
            raise ValueError("MonitorConfig.flops_per_token must be > 0")
        if self.peak_precision not in ("bf16", "fp8"):
            raise ValueError(
                f"MonitorConfig.peak_precision must be bf16 or fp8, got {self.peak_precision!r}"
            )
        if self.first_step < 0:
            raise ValueError(f"MonitorConfig.first_step must be >= 0, got {self.first_step}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"MonitorConfig.total_steps must be >= 1, got {self.total_steps}")
        if self.canary_every < 0 or self.power_interval_s < 0:
            raise ValueError("MonitorConfig.canary_every and power_interval_s must be >= 0")
        if not (math.isfinite(self.stopped_interval_s) and self.stopped_interval_s >= 0):
            raise ValueError(
                f"MonitorConfig.stopped_interval_s must be >= 0, got {self.stopped_interval_s}"
            )
        if self.loss_scaling not in LOSS_SCALING:
            raise ValueError(
                f"MonitorConfig.loss_scaling must be one of {list(LOSS_SCALING)}, "
                f"got {self.loss_scaling!r}"
            )
        if not (math.isfinite(self.heartbeat_interval_s) and self.heartbeat_interval_s > 0):
            raise ValueError(
                f"MonitorConfig.heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}"
            )
        if self.canary_dtype not in ("", "float32", "bfloat16", "float16"):
            raise ValueError(f"MonitorConfig.canary_dtype: unknown dtype {self.canary_dtype!r}")
