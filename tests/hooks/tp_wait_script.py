"""Worker of test_heartbeat.py: where a rank waits for a tensor-parallel peer that stopped
mid-forward (or mid-backward), as its heartbeat phase says it.

torchrun --nproc-per-node 2 tp_wait_script.py OUT_DIR [forward|backward]

Two CPU ranks, tp = 2 over gloo, the reference model metered by CommsMeter with a
heartbeat Liveness. Rank 1 sleeps HELD_S in its first block's feed-forward pre-hook
(forward or full backward: a peer stuck there); rank 0 runs on into that block's
all-reduce (the rowwise output's in forward, the colwise inputs' gradients' in backward)
and waits for it there. A thread on rank 0 reads its phase every few ms while the forward
(or the backward) runs and writes the phases seen, in order, to OUT_DIR/phases.json.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainvitals.hooks.comms import CommsMeter
from trainvitals.hooks.heartbeat import Liveness, PhaseHooks
from trainvitals.trainer.model import PRESETS, Transformer
from trainvitals.trainer.parallel import build_mesh, parallelize

HELD_S = 3.0  # long enough that rank 0 reaches the all-reduce and waits, on a busy machine


def main() -> None:
    out = Path(sys.argv[1])
    where = sys.argv[2] if len(sys.argv) > 2 else "forward"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    mesh = build_mesh("cpu", 1, 2)
    model = parallelize(Transformer(PRESETS["tiny"]), mesh)
    live = Liveness()
    meter = CommsMeter(model, mesh, torch.device("cpu"))
    meter.liveness = live
    phases = PhaseHooks(model, live)
    block = next(m for name, m in model.named_modules() if name.endswith("feed_forward"))
    if rank == 1 and where == "forward":
        block.register_forward_pre_hook(lambda _m, _i: time.sleep(HELD_S))
    elif rank == 1:
        block.register_full_backward_pre_hook(lambda _m, _g: time.sleep(HELD_S))
    tokens = torch.randint(0, 256, (2, 16))
    loss = model(tokens).float().mean() if where == "backward" else None
    seen: list[str] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if not seen or seen[-1] != live.phase:
                seen.append(live.phase)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    if loss is None:
        model(tokens)
    else:
        loss.backward()
    seen.append(f"after: {live.phase}")
    done.set()
    watcher.join()
    if rank == 0:
        (out / "phases.json").write_text(json.dumps(seen))
    phases.close()
    meter.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
