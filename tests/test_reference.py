"""The pure-torch reference row against an independent float64 numpy computation."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rowcheck import as_numpy_row, assert_rows_match
from stabilitywatch.formats import FORMATS, ROW_FORMATS
from stabilitywatch.stats.layout import (FMT_BASE, HIST_BINS, HIST_EMIN, N_STATS, Stat,
                                         init_row)
from stabilitywatch.stats.reference import reference_row

INF, NAN = math.inf, math.nan


def numpy_row(t: torch.Tensor, scale: float = 1.0) -> np.ndarray:
    """The statistics row computed with numpy in float64 (format counts on y = x * scale in
    float32, as the definitions say; float64 inputs stay float64), sums with math.fsum."""
    x = t.detach().reshape(-1).to(torch.float64).numpy()
    if t.dtype == torch.float64:
        y = np.abs(x * scale)
    else:
        y = np.abs(x.astype(np.float32) * np.float32(scale))
    row = init_row()
    fin = np.isfinite(x)
    xf = x[fin]
    nz = fin & (x != 0)
    row[Stat.NUMEL] = x.size
    row[Stat.NAN] = np.isnan(x).sum()
    row[Stat.POSINF] = (x == INF).sum()
    row[Stat.NEGINF] = (x == -INF).sum()
    row[Stat.ZEROS] = (fin & (x == 0)).sum()
    if xf.size:
        row[Stat.MIN], row[Stat.MAX], row[Stat.ABSMAX] = xf.min(), xf.max(), np.abs(xf).max()
    if nz.any():
        row[Stat.ABSMIN_NZ] = np.abs(x[nz]).min()
    row[Stat.SUM] = math.fsum(xf.tolist())
    row[Stat.SUMSQ] = math.fsum((xf * xf).tolist())
    k = x[0] if x.size and np.isfinite(x[0]) and x[0] != 0 else 0.0
    row[Stat.SHIFT] = k
    row[Stat.SHIFT_SUM] = math.fsum((xf - k).tolist())
    row[Stat.SHIFT_SUMSQ] = math.fsum(((xf - k) ** 2).tolist())
    for fmt in ROW_FORMATS:
        f, base = FORMATS[fmt], FMT_BASE[fmt]
        half = f.min_subnormal / 2
        row[base + 0] = (fin & (y > f.max)).sum()
        row[base + 1] = (nz & (y <= half)).sum()
        row[base + 2] = (fin & (y > half) & (y < f.min_normal - half)).sum()
    if t.dtype == torch.float64:
        b64 = x.view(np.uint64)
        bits = (b64 ^ (b64 >> np.uint64(32))) & np.uint64(0xFFFFFFFF)
    else:
        bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = np.where(np.isnan(x), np.uint64(0x7FC00000), bits)
    row[Stat.BITS_LO] = int((bits & np.uint64(0xFFFF)).sum())
    row[Stat.BITS_HI] = int((bits >> np.uint64(16)).sum())
    _, e = np.frexp(np.abs(x[nz]))
    bins = np.clip(e.astype(np.int64) - 1 - HIST_EMIN, 0, HIST_BINS - 1)
    row[Stat.HIST:] = np.bincount(bins, minlength=HIST_BINS)
    return row


def sample(kind: str, dtype: torch.dtype, n: int = 5000) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    if kind == "randn":
        x = torch.randn(n, generator=g, dtype=torch.float64)
    elif kind == "lognormal":
        x = torch.exp(9 * torch.randn(n, generator=g, dtype=torch.float64))
        x = x * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    elif kind == "specials":
        x = torch.randn(n, generator=g, dtype=torch.float64) * 1e-4
        x[::7], x[1::11], x[2::13], x[3::17], x[4::19] = NAN, INF, -INF, 0.0, -0.0
    elif kind == "fp8_bits":
        return torch.arange(256).to(torch.uint8).view(dtype)
    else:
        raise ValueError(kind)
    return x.to(dtype)


CASES = [("fp32", torch.float32, "randn"), ("fp32", torch.float32, "lognormal"),
         ("fp32", torch.float32, "specials"), ("bf16", torch.bfloat16, "lognormal"),
         ("bf16", torch.bfloat16, "specials"), ("fp16", torch.float16, "specials"),
         ("e4m3", torch.float8_e4m3fn, "fp8_bits"), ("e5m2", torch.float8_e5m2, "fp8_bits"),
         ("fp64", torch.float64, "lognormal"), ("fp64", torch.float64, "specials")]


@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**12], ids=["s1", "s0.37", "s4096"])
@pytest.mark.parametrize("dname,dtype,kind", CASES, ids=[f"{d}-{k}" for d, _, k in CASES])
def test_reference_matches_numpy(dname, dtype, kind, scale):
    x = sample(kind, dtype)
    got = reference_row(x, scale)
    assert got.dtype == torch.float64 and got.shape == (N_STATS,)
    assert_rows_match(got, numpy_row(x, scale), sum_rtol=1e-13, label=f"{dname} {kind} {scale}")


def test_scale_tensor_and_float_agree_and_layout_does_not_matter():
    x = sample("lognormal", torch.float32, 6000).reshape(60, 100)
    want = reference_row(x, 0.37)
    assert torch.equal(reference_row(x, torch.tensor(0.37)), want)
    assert_rows_match(reference_row(x.T, 0.37), want, label="transposed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float8_e4m3fn, torch.float8_e5m2, torch.float64],
                         ids=["fp32", "bf16", "fp16", "e4m3", "e5m2", "fp64"])
@pytest.mark.parametrize("shape", [(0,), (3, 0, 2)], ids=["0", "3x0x2"])
def test_empty_tensor_is_init_row(dtype, shape):
    row = reference_row(torch.empty(shape, dtype=dtype))
    assert row.dtype == torch.float64 and row.shape == (N_STATS,)
    np.testing.assert_array_equal(as_numpy_row(row), init_row())


N_BIG = 2**24 + 3  # not representable in float32: a float32 count would stick at 2**24


def test_counts_exact_past_2_pow_24():
    x = torch.full((N_BIG + 5,), 1000.0, dtype=torch.bfloat16)  # 1000 > e4m3 max
    x[-5:] = torch.tensor([0.0, -0.0, 0.0, NAN, -INF])
    row = reference_row(x)
    assert row[Stat.NUMEL].item() == N_BIG + 5
    assert (row[Stat.ZEROS].item(), row[Stat.NAN].item(), row[Stat.NEGINF].item()) == (3, 1, 1)
    assert row[Stat.E4M3_OVERFLOW].item() == N_BIG
    assert row[Stat.E5M2_OVERFLOW].item() == row[Stat.FP16_OVERFLOW].item() == 0
    assert row[Stat.HIST + (9 - HIST_EMIN)].item() == N_BIG  # floor(log2 1000) == 9
    assert row[Stat.SUM].item() == 1000.0 * N_BIG
    assert row[Stat.SUMSQ].item() == 1e6 * N_BIG


def test_float64_input_is_not_narrowed():
    x = torch.tensor([1e150, -1e150, 1e-310, -3.0, 0.0, INF, NAN], dtype=torch.float64)
    row = reference_row(x)
    assert (row[Stat.MAX].item(), row[Stat.MIN].item()) == (1e150, -1e150)
    assert row[Stat.ABSMIN_NZ].item() == 1e-310  # a float64 subnormal, zero in float32
    assert row[Stat.SUMSQ].item() == 1e150 * 1e150 * 2 + 9.0
    for fmt in ROW_FORMATS:
        assert row[FMT_BASE[fmt] + 0].item() == 2  # overflow: the two 1e150
        assert row[FMT_BASE[fmt] + 1].item() == 1  # underflow: 1e-310
    assert row[Stat.HIST].item() == 1 and row[Stat.HIST + HIST_BINS - 1].item() == 2
    assert_rows_match(row, numpy_row(x), sum_rtol=0.0, label="fp64")


def test_unsupported_dtype_raises():
    with pytest.raises(TypeError, match="unsupported"):
        reference_row(torch.arange(4, dtype=torch.int32))
