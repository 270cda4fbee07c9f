"""What the hooks cost the reference trainer's step, measured side by side in one job.

Identical copies of the reference model (same seed, same sharding) train in the same
processes: one without trainvitals, a second one without it (the control: how far two
identical copies differ on this machine), and one per logging interval with a monitor
attached (batches encoded to JSON on the export thread, written to /dev/null). They take
turns in blocks of steps, in a shuffled order, so that the machine's noise falls on every
copy alike. Each block is timed between two barriers (and device
synchronisations on a GPU). A round gives every copy the same steps, one logging interval's
worth at least; its ratio is a copy's time over the plain copy's in that round. The figure
is the median of the rounds' ratios, with a bootstrap 95% interval. Prints the overhead at
the hooks' default interval on its last line.

CPU reference run (4 ranks under torchrun, dp=2 x tp=2; the script starts torchrun itself):
    python bench/hook_overhead.py
One GPU, one process, turns of ten steps (a device sync after every step would expose
launch costs that a real run hides behind the device's work):
    python bench/hook_overhead.py --dp 1 --tp 1 --preset 125m --batch 16 --steps-per-block 10
The hooks' host work alone (Python, op dispatch), which a GPU run pays in full when its
host is as busy as its device: the preset's layers at a width of 16 and 4 tokens, so that
every op is dispatch, timed as the training thread's CPU time:
    python bench/hook_overhead.py --dp 1 --tp 1 --preset 125m --batch 1 --host-cost
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainvitals.hooks import MonitorConfig, attach
from trainvitals.hooks.exporter import JsonlExporter
from trainvitals.trainer.model import PRESETS, Transformer
from trainvitals.trainer.parallel import build_mesh, parallelize
from trainvitals.trainer.train import clip_grad_norm_

DEFAULT_EVERY = MonitorConfig.log_every  # the hooks' default logging interval
CONTROL = "off, a second copy"  # the noise floor: identical to "off"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per step, over all dp ranks")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument(
        "--steps-per-block", type=int, default=1, help="steps a copy runs before the next's turn"
    )
    p.add_argument(
        "--intervals",
        default=f"{DEFAULT_EVERY},1",
        help="logging intervals to measure, comma-separated (default: %(default)s)",
    )
    p.add_argument(
        "--host-cost",
        action="store_true",
        help="the preset's layers at width 16 and 4 tokens: the step is all dispatch",
    )
    args = p.parse_args()
    args.model = PRESETS[args.preset]
    # Host cost: the training thread's CPU time, which the export and sampler threads and
    # the machine's other work do not add to.
    args.clock = time.thread_time if args.host_cost else time.perf_counter
    if args.host_cost:
        args.model = dataclasses.replace(args.model, dim=16, n_heads=2, ffn_dim=16, max_seq_len=4)
    try:
        args.intervals = [int(x) for x in args.intervals.split(",")]
    except ValueError:
        p.error(f"--intervals must be whole numbers separated by commas, got {args.intervals!r}")
    if DEFAULT_EVERY not in args.intervals or min(args.intervals) < 1:
        p.error(f"--intervals must be positive and include the default, {DEFAULT_EVERY}")
    # A round holds the same number of logged steps at every interval.
    steps = math.lcm(*args.intervals, args.steps_per_block)
    args.blocks_per_round = steps // args.steps_per_block
    if args.dp < 1 or args.tp < 1 or args.batch % args.dp or args.rounds < 4:
        p.error("--dp and --tp must be >= 1, --batch a multiple of --dp, --rounds >= 4")
    return args


class Trainee:
    """One copy of the reference model with its optimizer, and a monitor or none."""

    def __init__(self, args, mesh, device: torch.device, log_every: int | None) -> None:
        torch.manual_seed(0)  # every copy, on every rank, starts from the same weights
        self.model = Transformer(args.model).to(device)
        if mesh is not None:
            parallelize(self.model, mesh)
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95))
        self.monitor = None
        if log_every is not None:
            self.monitor = attach(
                self.model,
                mesh,
                exporter=JsonlExporter(os.devnull),
                log_every=log_every,
                peak_flops_per_s=1e15,  # no CPU calibration: it would load the machine
                time_collectives=True,  # as the trainer runs them
            )

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """The reference trainer's step (trainer/train.py), without faults or a scheduler."""
        device = inputs.device
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        if self.monitor is not None:
            self.monitor.step(loss=loss, tokens=targets.numel(), lr=1e-4)
        clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def timed_block(
    trainee: Trainee, batch: tuple, steps: int, distributed: bool, clock=time.perf_counter
) -> float:
    """Seconds for `steps` steps, between two barriers (the device drained at both)."""

    def settle() -> None:
        if batch[0].device.type == "cuda":
            torch.cuda.synchronize()  # bench boundary, not in the hooks
        if distributed:
            dist.barrier()

    settle()
    start = clock()
    for _ in range(steps):
        trainee.step(*batch)
    settle()
    return clock() - start


def run_rounds(args, trainees: dict[str, Trainee], batch: tuple, distributed: bool) -> dict:
    """Seconds per step of every copy, one value per round. The copies take their turns in
    a shuffled order (the same on every rank), so that none always follows the same copy
    and inherits its leftovers, such as an export thread still busy with a logged step."""
    names = list(trainees)
    shuffle = random.Random(0).shuffle
    per_step: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        elapsed = dict.fromkeys(names, 0.0)
        for _ in range(args.blocks_per_round):
            order = names.copy()
            shuffle(order)
            for name in order:
                elapsed[name] += timed_block(
                    trainees[name], batch, args.steps_per_block, distributed, args.clock
                )
        for name in names:
            per_step[name].append(elapsed[name] / (args.blocks_per_round * args.steps_per_block))
    return per_step


def measure(args) -> None:
    distributed = "WORLD_SIZE" in os.environ
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh, dp_rank = None, 0
    if distributed:
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        mesh = build_mesh(device_type, args.dp, args.tp)
        dp_rank = mesh["dp"].get_local_rank()
    index = torch.cuda.current_device() if device_type == "cuda" else None
    device = torch.device(device_type, index)
    cfg = args.model
    generator = torch.Generator().manual_seed(dp_rank)  # tp peers share a batch, dp ranks differ
    shape = (args.batch // args.dp, cfg.max_seq_len + 1)
    tokens = torch.randint(0, cfg.vocab_size, shape, generator=generator)
    batch = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))

    trainees = {copy: Trainee(args, mesh, device, None) for copy in ("off", CONTROL)}
    trainees.update({f"every {n}": Trainee(args, mesh, device, n) for n in args.intervals})
    for trainee in trainees.values():  # warm-up: allocator, first collectives, export threads
        timed_block(trainee, batch, args.blocks_per_round * args.steps_per_block, distributed)
    per_step = run_rounds(args, trainees, batch, distributed)
    for trainee in trainees.values():
        if trainee.monitor is not None:
            trainee.monitor.close()
    if not distributed or dist.get_rank() == 0:
        report(args, device, per_step)
    if distributed:
        dist.destroy_process_group()


def median_with_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Median of the rounds' ratios and its bootstrap 95% interval (resampling rounds)."""
    values = np.asarray(ratios)
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(values, size=(2000, len(values))), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(np.median(values)), float(low), float(high)


def report(args, device: torch.device, per_step: dict[str, list[float]]) -> None:
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    cfg = args.model
    ranks = args.dp * args.tp
    steps_per_round = args.blocks_per_round * args.steps_per_block
    print(
        f"device: {name}; preset {args.preset}; {ranks} rank(s), dp={args.dp} x tp={args.tp}; "
        f"{args.batch} x {cfg.max_seq_len} tokens per step; {args.rounds} rounds of "
        f"{steps_per_round} steps per copy, turns of {args.steps_per_block} step(s)"
    )
    for copy, values in per_step.items():
        print(f"{copy}: median {statistics.median(values) * 1e3:.2f} ms/step")
    overhead, extra_s = {}, {}
    for copy in [CONTROL, *(f"every {n}" for n in args.intervals)]:
        pairs = list(zip(per_step[copy], per_step["off"], strict=True))
        overhead[copy] = median_with_interval([h / b - 1 for h, b in pairs])
        extra_s[copy] = median_with_interval([h - b for h, b in pairs])
        median, low, high = (100 * x for x in overhead[copy])
        print(
            f"{copy}: {median:+.2f}% step time (95% interval {low:+.2f}% to {high:+.2f}%), "
            f"{extra_s[copy][0] * 1e3:+.3f} ms/step"
        )
    default = f"every {DEFAULT_EVERY}"
    median, low, high = (100 * x for x in overhead[default])
    if args.host_cost:
        ms, low_ms, high_ms = (1e3 * x for x in extra_s[default])
        print(
            f"hooks' host time at the default interval (every {DEFAULT_EVERY} steps), {name}, "
            f"{cfg.n_layers} layers at width {cfg.dim}: {ms:+.3f} ms/step "
            f"(95% interval {low_ms:+.3f} to {high_ms:+.3f} ms), {median:+.2f}% of the step"
        )
        return
    print(
        f"hook overhead at the default interval (every {DEFAULT_EVERY} steps), {name}, "
        f"{ranks} rank(s) dp={args.dp} x tp={args.tp}, preset {args.preset}: {median:+.2f}% "
        f"(95% interval {low:+.2f}% to {high:+.2f}%)"
    )


def main() -> None:
    args = parse_args()
    ranks = args.dp * args.tp
    if ranks > 1 and "WORLD_SIZE" not in os.environ:
        # One BLAS thread per rank, as `trainvitals train` runs them.
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={ranks}", __file__, *sys.argv[1:]]  # fmt: skip
        sys.exit(subprocess.call(argv, env=env))
    measure(args)


if __name__ == "__main__":
    main()
