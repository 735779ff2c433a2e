"""The standard deviation keeps its precision when the mean is large against it (shifted sums in
the row, stats/layout.py), in the reference, in every kernel pass (under the interpreter) and
through every merge: micro-batches, rows of different shifts, ranks."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rowcheck import assert_rows_match
from stabilitywatch.distributed.merge import LocalFrame, merged_frames, payload_rows
from stabilitywatch.distributed.wire import LOCAL, Payload
from stabilitywatch.kernels import dispatch
from stabilitywatch.kernels.stats_triton import launch_row_stats, triton_row
from stabilitywatch.stats.buffer import StatsFrame
from stabilitywatch.stats.derive import derive
from stabilitywatch.stats.layout import (N_STATS, UNSET_SHIFT, Stat, init_row, init_row_tensor,
                                         merge_into, merge_rows, shift_is_set)
from stabilitywatch.stats.reference import reference_row

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def np_stats(t: torch.Tensor) -> dict:
    """mean, std (two-pass, population), l2norm of the finite values, in float64 numpy."""
    x = t.detach().reshape(-1).to(torch.float64).numpy()
    x = x[np.isfinite(x)]
    m = x.mean()
    return {"mean": m, "std": math.sqrt(np.mean((x - m) ** 2)), "l2norm": math.sqrt(np.sum(x * x))}


def check(d: dict, t: torch.Tensor, rtol: float = 1e-9, label: str = "") -> None:
    want = np_stats(t)
    for k, v in want.items():
        assert d[k] == pytest.approx(v, rel=rtol, abs=1e-300), (label, k, d[k], v)


def test_float64_large_mean_std_is_exact():
    g = torch.Generator().manual_seed(1)
    x = 1e8 + 0.01 * torch.randn(10000, generator=g, dtype=torch.float64)
    d = derive(reference_row(x).numpy())
    check(d, x, rtol=1e-7)
    assert abs(d["std"] - 0.01) < 3e-4   # not 1.4: the plain sums cancel to nothing here


def _big_mean(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    # values exact in the dtype around a mean large against the spread: 2^23 + small integers
    # (float32: all integers below 2^24 exist), 2^10 + small integers for fp16
    g = torch.Generator().manual_seed(seed)
    base = {torch.float32: 2.0**23, torch.float16: 2.0**10, torch.float64: 2.0**50}[dtype]
    return (base + torch.randint(-3, 4, (n,), generator=g).double()).to(dtype)


# n: one value; the general kernel; one interpreter tile (8192) and a tail
SIZES = {"1": 1, "127": 127, "4097": 4097, "tile+77": 8192 + 77}


@pytest.mark.interpreter
@pytest.mark.parametrize("scale", [1.0, 0.5], ids=["fast", "careful"])
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dname", ["fp32", "fp16"])
def test_kernel_passes_keep_the_std(dname, size, scale):
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[dname]
    x = _big_mean(dtype, SIZES[size], seed=SIZES[size])
    want = reference_row(x, scale)
    got = triton_row(x, scale)
    assert_rows_match(got, want, label=f"{dname} {size} {scale}")
    assert got[Stat.SHIFT].item() == x[0].item()
    d = derive(got.numpy(), scale)
    check(d, x, label=f"{dname} {size}")


@pytest.mark.interpreter
@pytest.mark.parametrize("dname", ["e4m3", "e5m2", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 3.0], ids=["s1", "s3"])
def test_other_dtypes_and_fp8_byte_pass_shifted_sums(dname, scale):
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
             "bf16": torch.bfloat16}[dname]
    g = torch.Generator().manual_seed(4)
    x = (200 + torch.randn(8192 + 33, generator=g)).to(dtype)
    want = reference_row(x, scale)
    got = triton_row(x, scale)
    assert_rows_match(got, want, label=dname)
    check(derive(got.numpy(), scale), x.float(), label=dname)


SHAPES = {
    "0": lambda x: x[:0],
    "1": lambda x: x[:1],
    "127": lambda x: x[:127],
    "4097": lambda x: x[:4097],
    "T": lambda x: x[:4096].reshape(64, 64).T,
    "slice": lambda x: x[:4096].reshape(64, 64)[:, ::3],
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dname", list(DTYPES))
def test_every_dtype_and_shape_against_numpy(dname, shape):
    g = torch.Generator().manual_seed(7)
    base = (5 + 3 * torch.randn(5000, generator=g, dtype=torch.float64)).to(DTYPES[dname])
    x = SHAPES[shape](base)
    row = dispatch.compute_row(x, backend="triton")  # float64 takes the reference
    assert_rows_match(row, reference_row(x), label=f"{dname} {shape}")
    d = derive(row.numpy())
    if x.numel() == 0:
        assert math.isnan(d["std"]) and math.isnan(d["l2norm"])
        assert not shift_is_set(np.array(row[Stat.SHIFT].item()))
        return
    check(d, x, rtol=1e-9, label=f"{dname} {shape}")
    first = x.reshape(-1)[0].double().item()
    assert row[Stat.SHIFT].item() == first


# ---- merges ---------------------------------------------------------------------------------

def _two_parts():
    g = torch.Generator().manual_seed(9)
    a = 1e8 + 0.01 * torch.randn(300, generator=g, dtype=torch.float64)
    b = 1e8 + 5.0 + 0.01 * torch.randn(200, generator=g, dtype=torch.float64)
    return a, b


def test_merge_rows_of_different_shifts():
    a, b = _two_parts()
    ra, rb = reference_row(a).numpy(), reference_row(b).numpy()
    assert ra[Stat.SHIFT] != rb[Stat.SHIFT]
    both = torch.cat([a, b])
    for rows in ([ra, rb], [rb, ra], [init_row(), ra, init_row(), rb]):
        m = merge_rows(np.stack(rows))
        check(derive(m), both, rtol=1e-7)
        assert m[Stat.SHIFT] == next(r[Stat.SHIFT] for r in rows if shift_is_set(r[Stat.SHIFT]))
    assert merge_rows(np.stack([init_row(), init_row()]))[Stat.SHIFT] == UNSET_SHIFT


def test_merge_into_device_rows_of_different_shifts():
    a, b = _two_parts()
    dst = init_row_tensor()
    merge_into(dst, reference_row(a))
    merge_into(dst, reference_row(b))
    assert dst[Stat.SHIFT].item() == a[0].item()
    check(derive(dst.numpy()), torch.cat([a, b]), rtol=1e-7)
    assert_rows_match(dst, merge_rows(torch.stack([reference_row(a), reference_row(b)]).numpy()),
                      merged=True)


@pytest.mark.interpreter
def test_micro_batches_into_one_kernel_row():
    # the second tensor's programs re-express their sums at the row's shift (the first's)
    a = _big_mean(torch.float32, 8192 + 100, seed=1)
    b = _big_mean(torch.float32, 3000, seed=2) + 2.0
    row = init_row_tensor()
    launch_row_stats(a, row)
    launch_row_stats(b, row, 0.5)
    launch_row_stats(a[5:], row)
    want = merge_rows(torch.stack([reference_row(a), reference_row(b, 0.5),
                                   reference_row(a[5:])]).numpy())
    assert row[Stat.SHIFT].item() == a[0].item()
    assert_rows_match(row, want, merged=True)
    check(derive(row.numpy()), torch.cat([a, b, a[5:]]), rtol=1e-9)


@pytest.mark.interpreter
def test_multi_tensor_launches_take_each_tensors_shift():
    # small tensors and a large tensor's tail (stats_multi), its full tiles (tile_multi)
    ts = [_big_mean(torch.float32, n, seed=n) + i for i, n in enumerate((5, 700, 140_000))]
    rows = init_row_tensor(rows=len(ts))
    dispatch.accumulate_many(ts, rows, list(range(len(ts))))
    for i, t in enumerate(ts):
        assert rows[i, Stat.SHIFT].item() == t[0].item()
        assert_rows_match(rows[i], reference_row(t), label=f"tensor {i}")
        check(derive(rows[i].numpy()), t, label=f"tensor {i}")


def test_ranks_merge_rows_of_different_shifts():
    a, b = _two_parts()
    payloads = []
    for rank, t in enumerate((a, b)):
        fr = StatsFrame(step=3, keys=[("m", "output")], rows=reference_row(t).numpy()[None],
                        scales=[1.0], phases=[0])
        lf = LocalFrame(end=0, frame=fr, key_ids=[17], kinds=[LOCAL])
        full, fp = payload_rows(lf, True)
        payloads.append(Payload(rank=rank, final=False, truncated=False, need=0, full=full, fp=fp))
    frames = merged_frames(payloads, {17: ("m", "output")}, [], 0, 2)
    row = frames[0].rows[0]
    assert row.shape == (N_STATS,) and row[Stat.SHIFT] == a[0].item()
    check(derive(row), torch.cat([a, b]), rtol=1e-7)


@pytest.mark.interpreter
def test_multi_tensor_launch_with_two_tensors_of_one_row():
    # two tensors of one row (and other shifts) in one call: each launch holds one of them
    a = _big_mean(torch.float32, 300, seed=3)
    b = _big_mean(torch.float32, 140_000, seed=4) + 2.0
    c = _big_mean(torch.float32, 50, seed=5) - 1.0
    rows = init_row_tensor(rows=2)
    launches = dispatch.accumulate_many([a, b, c, a[:7]], rows, [0, 0, 1, 0])
    for launch, _ in launches:  # the interpreter runs programs one by one: the race cannot show
        slots = launch.vals[2::4]
        assert len(set(slots)) == len(slots), slots
    want = merge_rows(torch.stack([reference_row(a), reference_row(b),
                                   reference_row(a[:7])]).numpy())
    assert rows[0, Stat.SHIFT].item() == a[0].item()
    assert_rows_match(rows[0], want, merged=True)
    check(derive(rows[0].numpy()), torch.cat([a, b, a[:7]]))
    assert_rows_match(rows[1], reference_row(c))
