"""The reference trainer: a Llama-style model on FSDP2 x TP, monitored by trainvitals.

Runs under torchrun (`torchrun --nproc-per-node 4 -m trainvitals.trainer.train --dp 2 --tp 2`)
or as a single process without any parallelism (the exactness reference). Reads top to
bottom: set-up, model, optimizer, data, monitor, loop.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from trainvitals.hooks import NullMonitor, attach
from trainvitals.hooks.exporter import HttpExporter, JsonlExporter, MultiExporter, NullExporter
from trainvitals.hooks.flops import flops_per_token
from trainvitals.hooks.spool import default_spool_dir

from . import checkpoint
from .checkpointer import Checkpointer
from .config import TrainConfig, add_arguments, from_args
from .data import ByteBatches, advance_to, data_index, generate_corpus, parse_windows
from .faults import FaultInjector
from .model import PRESETS, Transformer
from .parallel import build_mesh, parallelize


def cosine_with_warmup(cfg: TrainConfig):
    """LR multiplier: linear warm-up to 1, then cosine decay to min_lr_ratio at the last step."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps  # never 0: the first step already learns
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> None:
    """Clip by the global norm; with DTensor gradients the norm is made whole first."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch to the device without waiting: from pageable memory CUDA would first wait
    for all the work queued on the stream; from pinned memory the copy is queued like a
    kernel."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def make_exporter(cfg: TrainConfig, rank: int):
    """Every rank sends to the collector (its events); the file and OTLP exporters are made
    on node leaders only (torchrun's local rank 0), which export their node's ranks rows
    (hooks/topology.py); rank 0's file is --telemetry-file itself, another leader's
    <file>.rank<k>."""
    exporters = []
    leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if cfg.collector:
        exporters.append(HttpExporter(cfg.collector, spool_dir=default_spool_dir(rank)))
    if cfg.telemetry_file and leader:
        path = cfg.telemetry_file if rank == 0 else f"{cfg.telemetry_file}.rank{rank}"
        exporters.append(JsonlExporter(path))
    if cfg.otlp_endpoint and leader:  # the other ranks export nothing: no SDK import
        from trainvitals.hooks.otlp import OtlpExporter

        exporters.append(OtlpExporter(cfg.otlp_endpoint))
    return MultiExporter(exporters) if exporters else NullExporter()


def print_rerun_loss(step: int, loss: torch.Tensor, rank: int) -> None:
    """The re-run's verdict material: the step's loss, averaged over the ranks as the hooks
    report it (equal tokens per rank; tensor-parallel ranks hold the same loss)."""
    total = loss.detach().double().reshape(1)
    if dist.is_initialized():
        dist.all_reduce(total)  # gloo has no AVG: a sum, then / world size
        total /= dist.get_world_size()
    if rank == 0:
        print(f"rerun-loss {step} {total.item()!r}", flush=True)  # .item(): a sync, once


WARMUP_STEPS = 5  # excluded from the steady step time: allocator, first collectives

# FSDP2 warns when the root module returns a view, in case the caller modifies it in place;
# the loop below only reads the logits.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trainvitals.trainer.train", description=__doc__)
    add_arguments(parser)
    try:
        cfg = from_args(parser.parse_args(argv))  # checks the --inject specs too
    except ValueError as e:
        parser.error(str(e))

    distributed = "WORLD_SIZE" in os.environ
    device_type = (
        cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    mesh, rank, dp_rank = None, 0, 0
    if distributed:
        if int(os.environ["WORLD_SIZE"]) != cfg.world_size:
            started = os.environ["WORLD_SIZE"]
            sys.exit(f"error: torchrun started {started} ranks but dp x tp = {cfg.world_size}")
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        mesh = build_mesh(device_type, cfg.dp, cfg.tp)
        rank, dp_rank = dist.get_rank(), mesh["dp"].get_local_rank()
    elif cfg.world_size != 1:
        sys.exit(
            f"error: dp x tp = {cfg.world_size} needs torchrun (or `trainvitals train --nproc`)"
        )
    device = torch.device(
        device_type, torch.cuda.current_device() if device_type == "cuda" else None
    )

    dtype_name = (
        cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device_type == "cuda" else "float32")
    )
    compute_dtype = getattr(torch, dtype_name)  # parameters and optimizer stay float32

    # Every rank builds the same full model from the same seed; parallelize() then keeps its shards.
    torch.manual_seed(cfg.seed)
    model_cfg = PRESETS[cfg.preset]
    seq_len = cfg.seq_len_or_max
    model = Transformer(model_cfg).to(device)
    n_embedding = model.tok_embeddings.weight.numel()
    if mesh is not None:
        parallelize(model, mesh)
    params = list(model.parameters())

    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(cfg))
    batches = ByteBatches(
        generate_corpus(cfg.corpus_bytes, cfg.seed), seq_len, cfg.global_batch, cfg.seed
    )
    ckpt_root = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    try:  # a damaged checkpoint, or one of another model: one line, not a traceback per rank
        resumed = (
            checkpoint.resume(ckpt_root, model, optimizer, scheduler, cfg.checkpoint_meta())
            if cfg.resume
            else None
        )
    except ValueError as e:
        sys.exit(f"error: {e}")
    first_step = resumed.step + 1 if resumed else 0
    if resumed:
        checkpoint.restore_lr(optimizer, scheduler)
    skipped = parse_windows(cfg.skip_data)  # data windows never trained on

    monitor = (
        NullMonitor(cfg.run_id)
        if cfg.hooks == "off"
        else attach(
            model,
            mesh,
            exporter=make_exporter(cfg, rank),
            heartbeat_url=cfg.collector or "",  # every rank's own liveness, to the watchdog
            run_id=resumed.run_id if resumed else cfg.run_id,
            first_step=first_step,
            total_steps=cfg.steps,
            log_every=cfg.log_every,
            model_name=f"llama-{cfg.preset}",
            model_config={**model_cfg.to_dict(), "seq_len": seq_len},
            flops_per_token=None
            if cfg.count_flops
            else flops_per_token(
                model.num_params(),
                n_embedding,
                model_cfg.n_layers,
                model_cfg.n_heads,
                model_cfg.head_dim,
                seq_len,
            ),
            peak_flops_per_s=cfg.peak_flops_per_s or None,
            canary_every=cfg.canary_every,
            stopped_interval_s=cfg.stopped_interval_s,
            time_collectives=True,  # NCCL: per-kind collective time (no effect on gloo)
            token_target=cfg.steps * cfg.global_batch * seq_len,
        )
    )
    if rank == 0:
        print(
            f"run {monitor.run_id}: llama-{cfg.preset}, dp={cfg.dp} tp={cfg.tp}, {cfg.steps} steps",
            flush=True,
        )

    if resumed and rank == 0:
        print(f"resumed from {resumed.path} at step {first_step}", flush=True)
        # The new launch's size: a relaunch on fewer nodes has fewer ranks, which the run's
        # first runs row (kept by the store) does not say.
        detail = {"resumed_from_step": resumed.step, "load_s": resumed.load_s,
                  "world_size": cfg.world_size}  # fmt: skip
        monitor.event("restart", first_step, detail=detail)

    injector = FaultInjector(cfg.inject, rank, cfg.world_size, device, first_step)
    rerun = cfg.rerun_step >= 0  # a re-run of one step saves nothing
    saver = Checkpointer(
        ckpt_root, rank, cfg.checkpoint_meta(), monitor, 0 if rerun else cfg.checkpoint_every,
        0 if rerun else cfg.checkpoint_every_min, cfg.checkpoint_async, first_step,
    )  # fmt: skip
    for step in range(first_step, cfg.steps):
        injector.record(monitor, step)
        injector.arm_sdc(model, monitor, step)
        injector.arm_idle(model, step)
        injector.arm_crash_or_hang(model, step, monitor)
        injector.crash_or_hang(step, monitor)
        injector.clock.start()  # this rank's compute time, the straggler's baseline
        injector.wait_for_data(step)
        advance_to(batches, index := data_index(step, skipped))  # same data as an unbroken run
        injector.record_data(monitor, step, index)
        inputs, targets = injector.batch(
            step, *(to_device(t, device) for t in batches.next(dp_rank, cfg.dp)), index,
            dp_rank, cfg.dp,
        )  # fmt: skip
        with torch.autocast(
            device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32
        ):
            logits = model(inputs)
        loss = injector.loss(step, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()))
        if step == cfg.rerun_step:
            print_rerun_loss(step, loss, rank)
            break
        loss.backward()
        injector.slow_down(step)
        lr_factor = injector.lr_factor(step)
        monitor.step(loss=loss, tokens=targets.numel(), lr=scheduler.get_last_lr()[0] * lr_factor)
        clip_grad_norm_(params, cfg.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] *= lr_factor  # the scheduler's next step sets it back
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        injector.clock.end()
        if rank == 0 and (step % 50 == 0 or step == cfg.steps - 1):
            print(f"step {step:5d}  loss {loss.item():.4f}", flush=True)  # .item() is a sync point
        saver.after_step(step, monitor.run_id, model, optimizer, scheduler)
        injector.pause(step, monitor)
        if step == first_step + WARMUP_STEPS - 1:
            steady_start_s = time.perf_counter()

    steady_steps = cfg.steps - first_step - WARMUP_STEPS
    if rank == 0 and steady_steps > 0 and not rerun:
        steady_ms = (time.perf_counter() - steady_start_s) / steady_steps * 1e3
        first = first_step + WARMUP_STEPS
        print(f"steady step time: {steady_ms:.2f} ms (steps {first}-{cfg.steps - 1})")

    saver.wait()  # the last async save completes before the job ends
    monitor.close()
    if distributed:
        # Free the collectives' leftovers while the process group lives, and let every rank
        # get here before it goes: otherwise gloo now and then aborted the interpreter's
        # teardown ("terminate called without an active exception") after the last step,
        # and torchrun reported a clean run as failed.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
