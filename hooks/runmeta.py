"""What a run is, for its runs row: model, layout, devices, hosts; gathered once at attach."""

from __future__ import annotations

import json
import socket
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .flops import FLOPS_ESTIMATE, peak_flops
from .topology import Node, find_node, node_key

if TYPE_CHECKING:
    from .monitor import Monitor


def run_metadata(monitor: Monitor, model: nn.Module) -> tuple[dict[str, Any], Node]:
    """The runs row (schema.RUNS, with the run_id every rank agrees on, rank 0's) and this
    rank's node. Collective: every rank's node key and host are gathered once, here."""
    m = monitor
    n_params = sum(p.numel() for p in m.params)  # DTensor.numel() is the global size
    embed = sum(
        p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    )
    fpt = m.cfg.flops_per_token or 6.0 * (n_params - embed)
    # Without the model's own count, MFU rests on a dense transformer's rule (hooks/flops.py)
    # until the monitor counts the first step (flops.StepFlops), or when it cannot: the
    # dashboard labels it an estimate and says from what.
    flops_source = "configured" if m.cfg.flops_per_token else FLOPS_ESTIMATE
    peak, source = (
        (0.0, "") if m.rank else peak_flops(m.device, m.cfg.peak_flops_per_s, m.cfg.peak_precision)
    )
    shared = {
        "run_id": m.cfg.run_id or uuid.uuid4().hex[:12],
        "host": socket.gethostname(),
        "node": node_key(),
    }
    gathered = [shared]
    if m.distributed:
        gathered = [None] * m.world_size
        dist.all_gather_object(gathered, shared, group=m._group)  # sync point: once, at attach
    node = (
        find_node([g["node"] for g in gathered], m.rank, m._group)
        if m.distributed
        else Node((0,), 0)
    )
    sizes = {}
    if m.mesh is not None:
        sizes = {n: m.mesh.size(i) for i, n in enumerate(m.mesh.mesh_dim_names or ())}
    device_name = torch.cuda.get_device_name(m.device) if m.device.type == "cuda" else m.device.type
    row = {
        "run_id": gathered[0]["run_id"],  # rank 0's id, so every rank agrees
        "started_unix_s": time.time(),
        "model": m.cfg.model_name or type(model).__name__,
        "model_config_json": json.dumps(m.cfg.model_config),
        "n_params": n_params,
        "n_layers": len(m.layers.names),
        "layer_names_json": json.dumps(m.layers.names),
        "world_size": m.world_size,
        # Without a "dp" dimension (plain DDP, or other names) every rank not in
        # tensor parallelism is a data-parallel replica.
        "dp": sizes.get("dp", m.world_size // sizes.get("tp", 1)),
        "tp": sizes.get("tp", 1),
        "device_type": m.device.type,
        "device_name": device_name,
        "hosts_json": json.dumps([g["host"] for g in gathered]),
        "flops_per_token": float(fpt),
        "flops_source": flops_source,
        "peak_flops_per_s": peak,
        "peak_flops_source": source,
        "power_source": m.power.source,
        "power_unavailable": m.power.unavailable,
        "token_target": m.cfg.token_target,
        "loss_scaling": m.cfg.loss_scaling,
    }
    return row, node
