"""fp16 with a dynamic loss scaler: how many false `nonfinite` alerts do its overflows raise?

torch.amp.GradScaler overflows the gradients now and then by design (its scale grows until
they overflow, then halves) and skips those steps. Here a small MLP trains in fp16
autocast on the CPU with a real GradScaler, the hooks attached (`monitor.step` after
`scaler.unscale_`), and the analyzer reads the telemetry, once with the run's
`loss_scaling` left at "none" and once "dynamic". Per setting: the scaler's overflows (the
times it lowered its scale), how many of them fell on logged steps (only those carry
gradient counts), and the `nonfinite` alerts. A run whose gradients are infinite at any
scale from 80% of the way (a planted inf) must still be named under "dynamic".

    python bench/loss_scaling.py | tee bench/results/loss_scaling.txt
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
from torch import nn

from trainvitals.analyzer import Analyzer
from trainvitals.hooks import InMemoryExporter, attach
from trainvitals.schema import to_arrow


def train(args, seed: int, loss_scaling: str, init_scale: float, growth_interval: int,
          poison_from: int | None = None) -> tuple[int, int, list]:  # fmt: skip
    """(overflows, overflows on logged steps, nonfinite alerts) of one run."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
                          nn.Linear(64, 1))  # fmt: skip
    out = InMemoryExporter()
    monitor = attach(model, log_every=args.log_every, exporter=out, loss_scaling=loss_scaling,
                     total_steps=args.steps)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    scales = []
    for step in range(args.steps):
        x = torch.randn(32, 64)
        with torch.autocast("cpu", dtype=torch.float16):
            y = model(x)
        loss = (y.float() - x[:, :1]).square().mean()
        scaler.scale(loss).backward()
        if poison_from is not None and step >= poison_from:
            model[2].weight.grad[0, 0] = math.inf
        scaler.unscale_(opt)
        monitor.step(loss=loss, tokens=32)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    monitor.close()
    analyzer, alerts = Analyzer(), []
    for batch in out.batches:
        alerts += analyzer.observe(*to_arrow(batch))
    # scales[i] is the scale after step i: it fell after an overflow at step i.
    fell = [i for i, (a, b) in enumerate(itertools.pairwise(scales), 1) if b < a]
    if scales and scales[0] < init_scale:
        fell.insert(0, 0)
    logged = [i for i in fell if i % args.log_every == 0 or i == args.steps - 1]
    return len(fell), len(logged), [a for a in alerts if a.kind == "nonfinite"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args()
    # The scaler's defaults, and a fast-growing one (overflows about every 100 steps).
    setups = {"GradScaler defaults (2^16, growth every 2000 steps)": (2.0**16, 2000),
              "fast growth (2^24, growth every 100 steps)": (2.0**24, 100)}  # fmt: skip
    print(f"# {args.steps} steps x {args.seeds} seeds per setup, logged every {args.log_every}")
    totals = {"none": 0, "dynamic": 0}
    steps_total = 0
    for name, (init, growth) in setups.items():
        for seed in range(args.seeds):
            for scaling in ("none", "dynamic"):
                fell, logged, alerts = train(args, seed, scaling, init, growth)
                totals[scaling] += len(alerts)
                print(f"{name}, seed {seed}, loss_scaling={scaling}: {fell} overflows, "
                      f"{logged} on logged steps, {len(alerts)} nonfinite alerts",
                      flush=True)  # fmt: skip
            steps_total += args.steps
    poison = int(args.steps * 0.8)
    _, _, caught = train(args, 0, "dynamic", 2.0**16, 2000, poison_from=poison)
    first = caught[0].step if caught else None
    print(
        f"gradients infinite at any scale from step {poison}, loss_scaling=dynamic: "
        f"{len(caught)} alert(s), the first at step {first}"
    )
    per_10k = {k: 1e4 * v / steps_total for k, v in totals.items()}
    named = f"at step {first}" if caught else "never"
    print(f"fp16 with a GradScaler: false nonfinite alerts per 10,000 steps "
          f"{per_10k['none']:.1f} without loss_scaling, {per_10k['dynamic']:.1f} with "
          f"loss_scaling=dynamic; a gradient infinite at any scale from step {poison} "
          f"named {named}")  # fmt: skip


if __name__ == "__main__":
    main()
