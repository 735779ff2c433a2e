"""Cost model of the distributed flush at 1K, 10K and 100K ranks (docs/distributed.md).

    python benchmarks/dist_cost_model.py [--rows 240] [--sentinel 148] [--out DIR]

Bytes come from the flush's own layout (stabilitywatch/distributed/reduce.py, wire.py), not from
constants typed here. Host time is measured on this machine: the reduction's packing and
unpacking of one flush (independent of the world size: the tensors are), and the all-gather's
merge at a few world sizes, extrapolated linearly (it handles world x rows). Collective latency
is a model, with its parameters printed beside the table:

    ring all-reduce    2 (N - 1) a + 2 (N - 1) / N  B / bw
    tree all-reduce    2 log2(N) a + B / bw            (pipelined double binary tree)
    all-gather (ring)  (N - 1) a + (N - 1) B / bw      (B: one rank's buffer)

a: latency of one hop between nodes, bw: per-GPU network bandwidth (the slowest link a ring
or tree crosses is the inter-node one at these scales). Writes dist_cost_model.md.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stabilitywatch.distributed import details, reduce, rounds, wire  # noqa: E402
from stabilitywatch.distributed.merge import LocalFrame, merged_frames, payload_rows  # noqa: E402
from stabilitywatch.stats.buffer import Phase, StatsFrame  # noqa: E402
from stabilitywatch.stats.layout import N_STATS  # noqa: E402
from stabilitywatch.stats.reference import reference_row  # noqa: E402

WORLDS = (1_000, 10_000, 100_000)
# model parameters (assumptions, see docs/distributed.md)
NET_BW = 50e9          # bytes/s per GPU: one 400 Gb/s NDR InfiniBand NIC per GPU
HOP = 8e-6             # s per inter-node hop of a small message (NCCL LL protocol, order of)


class _Solo:
    """A one-rank "group": what each rank does on the host is the same at any world size."""
    calls = 0
    bytes_sent = 0

    def all_reduce(self, a, op):
        self.calls += 1
        self.bytes_sent += a.nbytes
        return np.array(a)

    def all_gather(self, buf):
        return [np.array(buf)]


def frames(rows: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    keys = [(f"blocks.{i // 4}.l{i % 4}", "output" if i % 2 else "weight") for i in range(rows)]
    table = np.stack([reference_row(torch.randn(64, generator=g)).numpy() for _ in keys])
    f = StatsFrame(step=5, keys=keys, rows=table, scales=[1.0] * rows,
                   phases=[Phase.FORWARD if k[1] == "output" else Phase.WEIGHT for k in keys])
    kinds = [wire.LOCAL | wire.OWNER if k[1] == "output" else wire.REPLICATED for k in keys]
    return [LocalFrame(end=1, frame=f, key_ids=[wire.key_id(*k) for k in keys], kinds=kinds)]


def reduce_bytes(rows: int, sentinel_rows: int, sampled: bool, tripped: bool) -> int:
    head = reduce.N_HEAD + rows + 1             # header, presence codes, tripped flag: round 1
    n = rows if sampled else 1                  # an unsampled step reads the loss alone
    sent = sentinel_rows if tripped else 0
    return 8 * (head + n * (reduce.WA + reduce.WB) + sent * (reduce.WSA + reduce.WSB))


def guard_flag_bytes(sentinel_rows: int) -> int:
    """The guard's every-step reduction (guard.CrossRankFlag): float32 flag codes and, per
    gradient, the lowest and highest bad rank."""
    return 4 * (2 + 2 * sentinel_rows)


def details_bytes(bad_rows: int) -> int:
    """The rare round after a bad merged row (distributed/details.py): two ranks' counts."""
    return 8 * bad_rows * 2 * len(details.ROW_FIELDS)


def gather_bytes(rows: int) -> int:
    return wire.size_of(rows, 0, b"")


def host_reduce_ms(rows: int, sampled: bool, repeats: int = 20) -> float:
    lfs = frames(rows)
    t = reduce.Tables()
    comm = _Solo()
    rounds.run(lfs, t, comm, 0, full=True, compare=True, final=False)   # agrees on the keys
    if not sampled:    # the table holds every row; this step end has one
        f = lfs[0].frame
        lfs = [LocalFrame(end=1, frame=StatsFrame(step=6, keys=f.keys[:1], rows=f.rows[:1],
                                                  scales=[1.0], phases=f.phases[:1]),
                          key_ids=lfs[0].key_ids[:1], kinds=lfs[0].kinds[:1])]
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        red = rounds.run(lfs, t, comm, 0, full=True, compare=True, final=False)
        rounds.merged(red, lfs, t, 0, 1, lambda k: False)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def host_gather_ms(rows: int, world: int) -> float:
    lf = frames(rows)[0]
    full, fp = payload_rows(lf, True)
    names = [[k, *n] for k, n in zip(lf.key_ids, lf.frame.keys)]
    buf, _ = wire.encode(0, False, full, fp, names, 1 << 24)
    base = wire.decode(buf)
    payloads = []
    for r in range(world):
        p = wire.decode(buf)
        p.rank = r
        payloads.append(p)
    names_d = {k: (m, ro) for k, m, ro in base.names}
    t0 = time.perf_counter()
    merged_frames(payloads, names_d, [lf], 0, world)
    return (time.perf_counter() - t0) * 1e3


def ring(n, b):
    return 2 * (n - 1) * HOP + 2 * (n - 1) / n * b / NET_BW


def tree(n, b):
    return 2 * math.log2(n) * HOP + b / NET_BW


def ring_gather(n, b):
    return (n - 1) * HOP + (n - 1) * b / NET_BW


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=240)
    p.add_argument("--sentinel", type=int, default=148)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    R, S = a.rows, a.sentinel
    h_red = {True: host_reduce_ms(R, True), False: host_reduce_ms(R, False)}
    g_small, g_big = host_gather_ms(R, 8), host_gather_ms(R, 64)
    per_rank = max(g_big - g_small, 1e-6) / (64 - 8)
    cases = {
        "reduce, sampled step": (reduce_bytes(R, S, True, False), True),
        "reduce, unsampled step (the loss row)": (reduce_bytes(R, S, False, False), False),
        "reduce, unsampled step, a sentinel tripped": (reduce_bytes(R, S, False, True), False),
        "reduce, the details round after one bad row": (details_bytes(1), None),
        "the guard's flags, every step (guard on)": (guard_flag_bytes(S), None),
    }
    gb = gather_bytes(R)
    lines = [f"Flush cost per step, {R} rows per sampled step, {S} gradients in the sentinel "
             f"(model: {NET_BW / 1e9:.0f} GB/s per GPU, {HOP * 1e6:.0f} us per inter-node hop; "
             f"host times measured on this machine)", "",
             "| ranks | mode | sent B/rank | received B/rank | tree all-reduce ms | "
             "ring all-reduce ms | host ms |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for n in WORLDS:
        for name, (b, sampled) in cases.items():
            host = "-" if sampled is None else f"{h_red[sampled]:.2f}"
            lines.append(f"| {n:,} | {name} | {b:,} | {b:,} | {tree(n, b) * 1e3:.2f} | "
                         f"{ring(n, b) * 1e3:.1f} | {host} |")
        host_g = g_small + per_rank * (n - 8)
        lines.append(f"| {n:,} | all-gather (dist_merge=\"gather\"), sampled step | {gb:,} | "
                     f"{n * gb:,} | - | {ring_gather(n, gb) * 1e3:,.0f} (ring all-gather) | "
                     f"{host_g:,.0f} |")
    lines += ["", f"Host time of the reduction (packing and unpacking one flush, best of 20): "
              f"{h_red[True]:.2f} ms sampled ({R} rows), {h_red[False]:.2f} ms unsampled. "
              f"All-gather merge: {g_small:.1f} ms at 8 ranks, {g_big:.1f} ms at 64, "
              f"+{per_rank:.3f} ms per rank (extrapolated). Latency columns: the model above; "
              f"the rounds of a flush run one after another (2-3 all-reduces; 1 when nothing "
              f"but round 1 is due), so a flush costs that many times the column; on the job's "
              f"NCCL group they are queued on the device, one per step end, and the host does "
              f"not wait for them."]
    text = "\n".join(lines)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dist_cost_model.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
