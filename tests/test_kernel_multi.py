"""Many tensors in one launch (kernels/stats_multi.py), under the interpreter: each row equals the
reference row of its tensor, whatever the mix of sizes, and the buffer's add_many writes the same
rows as one add() per tensor."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from rowcheck import assert_rows_match  # noqa: E402

from stabilitywatch.kernels import dispatch  # noqa: E402
from stabilitywatch.kernels.dispatch import MULTI_MAX  # noqa: E402
from stabilitywatch.kernels.stats_multi import launch_many  # noqa: E402
from stabilitywatch.stats.buffer import StatsBuffer  # noqa: E402
from stabilitywatch.stats.layout import init_row_tensor  # noqa: E402
from stabilitywatch.stats.reference import reference_row  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def tensors(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (1, 127, 4097, 9000):
        x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
        x[:: 11] = 0.0
        if n > 100:
            x[3], x[7] = float("nan"), float("-inf")
        out.append(x.to(dtype))
    return out


@pytest.mark.parametrize("dname", list(DTYPES))
def test_each_row_is_its_tensors(dname):
    ts = tensors(DTYPES[dname])
    rows = torch.stack([init_row_tensor("cpu") for _ in range(7)])
    slots = [5, 0, 3, 6]
    launch_many([t.view(-1) for t in ts], rows, slots)
    for t, s in zip(ts, slots):
        assert_rows_match(rows[s], reference_row(t), label=f"{dname} n={t.numel()}")
    untouched = torch.stack([init_row_tensor("cpu")])[0]
    for s in (1, 2, 4):
        assert torch.equal(rows[s], untouched)


def test_buffer_add_many_matches_one_add_per_tensor():
    # mixed dtypes, one tensor too large to batch, one scaled (its own launch), a strided view
    ts = tensors(torch.float32) + tensors(torch.bfloat16, seed=1)
    big = torch.randn(MULTI_MAX + 3)
    strided = torch.randn(64, 80)[:, ::3]
    items = [(t, f"m{i}", "weight", 1.0) for i, t in enumerate(ts)]
    items += [(big, "big", "weight", 1.0), (strided, "s", "weight", 1.0),
              (ts[2], "scaled", "weight", 0.5)]
    one, many = StatsBuffer(backend="triton"), StatsBuffer(backend="triton")
    for b in (one, many):
        b.begin_step(0)
    for t, m, r, s in items:
        one.add(t, m, r, 1, scale=s)
    many.add_many(items, 1)
    assert dispatch.batchable(ts[0], 1.0, "triton") and not dispatch.batchable(big, 1.0, "triton")
    assert not dispatch.batchable(ts[0], 0.5, "triton")
    for b in (one, many):
        b.end_step()
    f1, f2 = one.poll(block=True)[0], many.poll(block=True)[0]
    assert f1.keys == f2.keys
    for i, key in enumerate(f1.keys):
        assert_rows_match(f2.rows[i], f1.rows[i], label=str(key))
