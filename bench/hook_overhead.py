"""Cost of the trainvitals hooks on a training step, measured side by side.

Two identical models train in alternating blocks of steps, one with a monitor attached
(statistics every `--log-every` steps, batches encoded to JSON on the export thread) and
one without. Alternating blocks spreads the machine's noise over both; the figure is the
ratio of median per-step times. Prints the overhead on its last line.

    python bench/hook_overhead.py --preset small --steps-per-block 10 --blocks 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from trainvitals.hooks import attach
from trainvitals.hooks.exporter import JsonlExporter
from trainvitals.trainer.model import PRESETS, Transformer


def make(preset: str, device: torch.device) -> tuple[Transformer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer(PRESETS[preset]).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def block(model, opt, monitor, batch: torch.Tensor, steps: int, device: torch.device) -> float:
    """Seconds per step over `steps` steps (the device is drained at both ends)."""
    if device.type == "cuda":
        torch.cuda.synchronize()  # bench boundary, not in the hooks
    start = time.perf_counter()
    for _ in range(steps):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(batch)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.flatten())
        loss.backward()
        if monitor is not None:
            monitor.step(loss=loss, tokens=batch.numel())
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps-per-block", type=int, default=10)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--log-every", type=int, default=1)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = PRESETS[args.preset]
    batch = torch.randint(0, cfg.vocab_size, (args.batch, cfg.max_seq_len), device=device)

    plain, plain_opt = make(args.preset, device)
    watched, watched_opt = make(args.preset, device)
    monitor = attach(
        watched, exporter=JsonlExporter(os.devnull), log_every=args.log_every, peak_flops_per_s=1e15
    )
    for _ in range(2):  # warm-up: allocator, kernels, the export thread
        block(plain, plain_opt, None, batch, args.steps_per_block, device)
        block(watched, watched_opt, monitor, batch, args.steps_per_block, device)
    base, hooked = [], []
    for _ in range(args.blocks):
        base.append(block(plain, plain_opt, None, batch, args.steps_per_block, device))
        hooked.append(block(watched, watched_opt, monitor, batch, args.steps_per_block, device))
    monitor.close()
    base_s, hooked_s = statistics.median(base), statistics.median(hooked)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device: {name}; preset {args.preset}; batch {args.batch} x {cfg.max_seq_len} tokens")
    print(f"median step without hooks: {base_s * 1e3:.2f} ms; with hooks: {hooked_s * 1e3:.2f} ms")
    print(
        f"hook overhead: {100 * (hooked_s / base_s - 1):+.2f}% step time "
        f"(preset {args.preset}, {name}, log_every {args.log_every})"
    )


if __name__ == "__main__":
    main()
