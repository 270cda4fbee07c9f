"""The hooks' cost on one rank at simulated world sizes of 1,024 to 100,000 ranks.

No collective runs: each rank's share of them is laid out at its real size (the SUM and MAX
vectors every rank reduces, the node's slots its leader gathers), and the host work a rank
does per logged step runs for real, with the same functions the monitor calls:

- pack: the training thread's concatenation of the vectors and the gather buffer (torch,
  CPU); the device work before it (norms) does not depend on the world size;
- rows: on the export thread, the reduced vectors into columns (records.add_step on rank 0,
  records.add_ranks of the node's ranks on every node leader) and their msgpack encoding
  (wire.ColumnBatch.to_msgpack), the body an HttpExporter posts.

CPU time is the working thread's (time.thread_time, so another process on a shared
machine does not inflate it). The GIL hold is the longest time a probe thread, which asks
for the GIL every 50 us, waited for it while the work ran: what the training thread
would wait at most. Both are medians over repetitions. Wire bytes per point: body bytes
over the values (non-null cells) it carries. attach's one-off O(world) work (finding the
node's ranks among every rank's node key) is timed too, with new_group stubbed.

    python bench/hooks_scale.py                 # 1,024, 16,384 and 100,000 ranks
    python bench/hooks_scale.py --layers 128 --ranks-per-node 8 --repeats 30

Its last line: at 100,000 ranks, the worst rank's cpu_ms= and gil_ms= per logged step and
wire_bytes_per_point= over everything sent for one logged step (gzipped msgpack, as
HttpExporter sends it; the table gives the plain msgpack figure beside it).
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import threading
import time
from functools import partial
from unittest import mock

import numpy as np
import torch

from trainvitals.hooks import topology
from trainvitals.hooks.records import (
    RANK_SLOT,
    StepMeta,
    VectorLayout,
    add_ranks,
    add_step,
    release_unix_s,
)
from trainvitals.hooks.wire import ColumnBatch, gzipped

WORLDS = (1_024, 16_384, 100_000)
_FINGERPRINTS = ("canary_fingerprint", "replica_fingerprint")


def slots(n: int, rng: np.random.Generator) -> np.ndarray:
    """n ranks' slots as a GPU run fills them on a step without a canary: every value
    measured, the fingerprints NaN (not taken this step)."""
    out = rng.uniform(0.1, 1000.0, size=(n, len(RANK_SLOT)))
    out[:, RANK_SLOT.index("arrival_unix_s")] = 1.8e9 + rng.uniform(0, 0.01, n)
    out[:, RANK_SLOT.index("throttle_reasons")] = 0.0
    out[:, RANK_SLOT.index("replica_group")] = np.arange(n) % 8
    for name in _FINGERPRINTS:
        out[:, RANK_SLOT.index(name)] = np.nan
    return out


def reduced(layout: VectorLayout, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    v = rng.uniform(1.0, 10.0, layout.size)
    v_max = rng.uniform(1.0, 10.0, layout.max_size)
    v_max[-1] = 1.8e9 + 0.02  # the last arrival (slots() draws them below it)
    return v, v_max


def pack(layout: VectorLayout, per_node: int) -> None:
    """The training thread's share: the vectors as _launch concatenates them, the slot, and
    the gather buffer of the node (all on the host here)."""
    n = layout.n_layers
    blocks = [torch.rand(n, dtype=torch.float64) for _ in range(7)]
    host = torch.rand(n + 6 + len(RANK_SLOT), dtype=torch.float64)
    slot = host[n + 6 :].clone()
    torch.cat([*blocks, host[n : n + 6], slot[:2]])
    torch.cat([blocks[0], blocks[1], blocks[2][:1], slot[:1], slot[5:6]])
    slot.new_empty(per_node * len(RANK_SLOT))


def leader_rows(layout, v, v_max, node_slots, ranks, rank0: bool, world: int) -> bytes:
    batch = ColumnBatch("scale")
    meta = StepMeta(1000, 1e-4, 6e9, 1e15)
    if rank0:
        add_step(batch, layout, v, v_max, meta, world)
    add_ranks(batch, meta.step, ranks, node_slots, release_unix_s(layout, v_max))
    return batch.to_msgpack()


def gunzip(body: bytes) -> bytes:
    return gzip.decompress(body)


def values_in(body: bytes) -> int:
    """Non-null cells of a msgpack batch (binary columns: 8 bytes each, minus nulls)."""
    from trainvitals.schema import decode_msgpack, to_arrow

    _, tables = to_arrow(decode_msgpack(body))
    return sum(t.num_rows * (t.num_columns - 1) - sum(c.null_count for c in t.columns[1:])
               for t in tables.values())  # fmt: skip


def probe(done: threading.Event, longest: list[float]) -> None:
    """Ask for the GIL every 50 us until `done`; keep the longest wait beyond that."""
    last = time.perf_counter()
    while not done.is_set():
        time.sleep(50e-6)  # releases the GIL; waking needs it back
        now = time.perf_counter()
        longest[0] = max(longest[0], now - last - 50e-6)
        last = now


def timed(work, repeats: int) -> tuple[float, float]:
    """(median CPU ms of `work` on its thread, median longest GIL wait of a probe, ms)."""
    cpu, gil = [], []
    for _ in range(repeats):
        done, waits = threading.Event(), [0.0]
        t = threading.Thread(target=probe, args=(done, waits))
        t.start()
        time.sleep(0.002)
        start = time.thread_time()
        work()
        cpu.append(time.thread_time() - start)
        done.set()
        t.join()
        gil.append(waits[0])
    return statistics.median(cpu) * 1e3, statistics.median(gil) * 1e3


def step_work(layout, per_node, v, v_max, node_slots, ranks, rank0: bool, world: int) -> None:
    """One logged step's host work on a node leader (rank 0 with `rank0`)."""
    pack(layout, per_node)
    gzipped(leader_rows(layout, v, v_max, node_slots, ranks, rank0, world))


def attach_scan_ms(world: int, per_node: int) -> float:
    keys = [f"node{r // per_node}/0" for r in range(world)]
    with mock.patch.object(topology.dist, "new_group", lambda *a, **k: object()):
        topology._GROUPS.clear()
        start = time.thread_time()
        topology.find_node(keys, world - 1)
        return (time.thread_time() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--layers",
        type=int,
        default=128,
        help="layers with statistics (Llama 405B: 126 blocks + 2)",
    )
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    s, per_node = len(RANK_SLOT), args.ranks_per_node
    layout = VectorLayout(args.layers, tuple([10**9] * args.layers))
    print(f"layers={args.layers} ranks_per_node={per_node} rank_slot={s} values; "
          f"torch {torch.__version__}, {args.repeats} repeats, medians")  # fmt: skip
    names = [("ranks", 8), ("reduced B/rank", 15), ("(one-vector B)", 15),
             ("gathered B/leader", 18), ("sent B/leader", 14), ("sent B rank0", 13),
             ("cpu ms rank0", 13), ("gil ms rank0", 13), ("cpu ms leader", 14),
             ("gil ms leader", 14), ("B/point", 8), ("(no gzip)", 10),
             ("attach ms", 10)]  # fmt: skip
    print(" ".join(f"{name:>{width}}" for name, width in names))
    last = None
    for world in WORLDS:
        v, v_max = reduced(layout, rng)
        node = slots(per_node, rng)
        ranks0 = np.arange(per_node)
        ranks_k = np.arange(world - per_node, world)
        body0 = leader_rows(layout, v, v_max, node, ranks0, True, world)
        body_k = leader_rows(layout, v, v_max, node, ranks_k, False, world)

        rank0 = partial(step_work, layout, per_node, v, v_max, node, ranks0, True, world)
        leader = partial(step_work, layout, per_node, v, v_max, node, ranks_k, False, world)
        cpu0, gil0 = timed(rank0, args.repeats)
        cpu_k, gil_k = timed(leader, args.repeats)
        nodes = world // per_node
        raw_bytes = len(body0) + (nodes - 1) * len(body_k)
        body0, body_k = gzipped(body0), gzipped(body_k)  # as HttpExporter sends them
        wire_bytes = len(body0) + (nodes - 1) * len(body_k)
        points = values_in(gunzip(body0)) + (nodes - 1) * values_in(gunzip(body_k))
        reduced_b = (layout.size + layout.max_size) * 8
        one_vector_b = (layout.size - 6 + s * world + layout.max_size - 2) * 8  # before
        print(f"{world:>8,} {reduced_b:>15,} {one_vector_b:>15,} {per_node * s * 8:>18,}"
              f" {len(body_k):>14,} {len(body0):>13,} {cpu0:>13.3f} {gil0:>13.3f}"
              f" {cpu_k:>14.3f} {gil_k:>14.3f} {wire_bytes / points:>8.2f}"
              f" {raw_bytes / points:>10.2f}"
              f" {attach_scan_ms(world, per_node):>10.1f}")  # fmt: skip
        last = (world, max(cpu0, cpu_k), max(gil0, gil_k), wire_bytes / points)
    world, cpu, gil, bpp = last
    print(f"at {world:,} ranks, worst rank per logged step: cpu_ms={cpu:.3f} gil_ms={gil:.3f} "
          f"wire_bytes_per_point={bpp:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
