"""Numbers at the edges: bad scales, all-NaN tensors, negative-bit views, float64 inputs; kernel
(under the interpreter) and reference agree field by field, and derived values mean something."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rowcheck import assert_rows_match
from stabilitywatch import Config, tensor_stats
from stabilitywatch.formats import FORMATS, ROW_FORMATS
from stabilitywatch.kernels import dispatch
from stabilitywatch.kernels.stats_triton import launch_row_stats, triton_row
from stabilitywatch.stats.derive import derive
from stabilitywatch.stats.layout import FMT_BASE, Stat, init_row_tensor, merge_rows
from stabilitywatch.stats.reference import reference_row
from stabilitywatch.stats.scale import effective_scale

INF, NAN = math.inf, math.nan
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

# one full interpreter tile (8192 elements; fp8 tiles hold 8192 too) and a tail of 5: the tile
# kernel's careful pass (fp32, bf16), its fp8 byte-count pass (scaled fp8) and the general kernel
N = 8192 + 5
BAD = {"1e-50": 1e-50, "1e39": 1e39, "nan": NAN, "+inf": INF, "-inf": -INF, "-2": -2.0,
       "0": 0.0, "subnormal": 1e-40, "-0": -0.0}
DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn,
      "e5m2": torch.float8_e5m2}


def _data(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, generator=g) * torch.exp(3 * torch.randn(N, generator=g))
    x[:7] = 0.0
    x[100:103] = torch.tensor([NAN, INF, -INF])
    return x.to(dtype)


def _scale(v: float, form: str):
    return {"float": v, "tensor32": torch.tensor(v, dtype=torch.float32),
            "tensor64": torch.tensor(v, dtype=torch.float64)}[form]


def _counts(row) -> dict:
    return {f"{fmt.value}_{k}": float(row[FMT_BASE[fmt] + i])
            for fmt in ROW_FORMATS for i, k in enumerate(("over", "under", "sub"))}


@pytest.mark.interpreter
@pytest.mark.parametrize("form", ["float", "tensor32", "tensor64"])
@pytest.mark.parametrize("sname", list(BAD))
@pytest.mark.parametrize("dname", list(DT))
def test_bad_scale_kernel_equals_reference(dname, sname, form):
    x = _data(DT[dname])
    s = _scale(BAD[sname], form)
    want = reference_row(x, s)
    assert_rows_match(triton_row(x, s), want, label=f"{dname} scale {sname} {form}")
    # the rule itself (stats/scale.py), on the reference's counts
    eff = effective_scale(BAD[sname])
    xf = x.float()
    fin = xf.isfinite()
    nonzero = float((fin & (xf != 0)).sum())
    c = _counts(want)
    if eff == INF:      # NaN, +-inf, 1e39: every nonzero finite value overflows, zeros never
        assert all(c[f"{f.value}_over"] == nonzero for f in ROW_FORMATS), c
        assert all(c[f"{f.value}_under"] == 0 == c[f"{f.value}_sub"] for f in ROW_FORMATS), c
    elif eff == 0.0:    # 0, -0, 1e-50 and float32 subnormals: every nonzero value underflows
        assert all(c[f"{f.value}_under"] == nonzero for f in ROW_FORMATS), c
        assert all(c[f"{f.value}_over"] == 0 == c[f"{f.value}_sub"] for f in ROW_FORMATS), c
    else:               # a negative scale counts as its magnitude
        assert_rows_match(want, reference_row(x, abs(BAD[sname])), sum_rtol=0.0)


@pytest.mark.interpreter
def test_bad_tensor_scale_through_dispatch_and_a_second_launch():
    # a bad device scale merges into a row already holding another tensor's statistics
    a, b = _data(torch.float32), _data(torch.bfloat16)[:300]
    row = init_row_tensor()
    dispatch.accumulate(a, row, torch.tensor(NAN), backend="triton")
    launch_row_stats(b, row, torch.tensor(-0.5))
    want = reference_row(a, NAN)
    want2 = reference_row(b, 0.5)
    assert_rows_match(row, merge_rows(torch.stack([want, want2]).numpy()))


@pytest.mark.parametrize("sname", list(BAD))
def test_derived_headroom_follows_the_scale_rule(sname):
    x = torch.tensor([0.5, -3.0, 0.0, 100.0])
    d = derive(reference_row(x, BAD[sname]).numpy(), BAD[sname])
    eff = effective_scale(BAD[sname])
    for fmt in ROW_FORMATS:
        h = d[f"{fmt.value}_headroom_bits"]
        if eff == INF:
            assert h == -INF          # nothing fits: infinitely far past the format's max
            assert d[f"{fmt.value}_overflow_frac"] == 0.75  # three nonzero of four finite
        elif eff == 0.0:
            assert math.isnan(h)      # absmax * scale is 0: no scaled value to place
            assert d[f"{fmt.value}_underflow_frac"] == 1.0
        else:
            assert h == pytest.approx(math.log2(FORMATS[fmt].max / (100.0 * abs(BAD[sname]))))


@pytest.mark.parametrize("v", [1e-50, 1e39, 1e-40, 2.0**-127, 3.5e38])
def test_config_refuses_scales_outside_float32_normal_range(v):
    with pytest.raises(ValueError, match=r"scales\['output'\].*float32"):
        Config(scales={"output": v})


def test_config_takes_the_ends_of_float32_normal_range():
    c = Config(scales={"a": 2.0**-126, "b": float(np.finfo(np.float32).max)})
    assert c.scales == {"a": 2.0**-126, "b": float(np.finfo(np.float32).max)}


# ---- all-NaN tensors ------------------------------------------------------------------------

@pytest.mark.interpreter
@pytest.mark.parametrize("fill", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("n", [3, N], ids=["3", "tile+5"])
def test_no_finite_value_gives_nan_value_statistics(fill, n):
    x = torch.full((n,), fill)
    x[::2] = -fill if fill == INF else fill
    row = reference_row(x)
    assert_rows_match(triton_row(x), row, label="kernel")
    assert row[Stat.SUM].item() == 0.0 and row[Stat.SUMSQ].item() == 0.0  # merge identity
    d = derive(row.numpy())
    for k in ("min", "max", "absmax", "sum", "mean", "std", "rms", "l2norm"):
        assert math.isnan(d[k]), (k, d[k])
    assert d["finite"] == 0 and d["numel"] == n


def test_all_zero_tensor_keeps_zero_sums():
    d = derive(reference_row(torch.zeros(5)).numpy())
    assert (d["sum"], d["l2norm"], d["mean"], d["std"]) == (0.0, 0.0, 0.0, 0.0)


def test_tensor_stats_of_all_nan():
    d = tensor_stats(torch.full((4,), NAN))
    assert math.isnan(d["sum"]) and math.isnan(d["l2norm"]) and d["nan"] == 4


# ---- negative-bit views -----------------------------------------------------------------------

@pytest.mark.interpreter
@pytest.mark.parametrize("n", [5, N], ids=["5", "tile+5"])
def test_conj_imag_view_is_read_with_its_sign(n):
    g = torch.Generator().manual_seed(5)
    c = torch.complex(torch.randn(n, generator=g), torch.randn(n, generator=g) + 0.5)
    v = c.conj().imag
    assert v.is_neg()
    plain = (-c.imag).clone()
    want = reference_row(plain)
    assert_rows_match(reference_row(v), want, sum_rtol=0.0, label="reference")
    assert_rows_match(dispatch.compute_row(v, backend="triton"), want, label="kernel")
    assert not dispatch.viewable(v)  # a kept multi-tensor launch must not take a copy's address
    assert tensor_stats(v)["min"] == plain.min().item()


# ---- float64 inputs -------------------------------------------------------------------------

def test_float64_inputs_are_compared_in_float64():
    # each value sits where float32 would change its count: just above E4M3's max (float32
    # rounds it to 448), beyond float32's range (Inf in float32), below it (0 in float32), just
    # above half E4M3's smallest subnormal (float32 rounds it down onto the threshold)
    half = FORMATS[ROW_FORMATS[0]].underflow_threshold
    x = torch.tensor([448.0 * (1 + 2.0**-40), 1e39, 1e-50, half * (1 + 2.0**-40)],
                     dtype=torch.float64)
    row = reference_row(x)
    e4 = FMT_BASE[ROW_FORMATS[0]]
    assert row[e4].item() == 2          # 448(1+2^-40) and 1e39 overflow
    assert row[e4 + 1].item() == 1      # only 1e-50 rounds to zero
    assert row[e4 + 2].item() == 1      # half(1+2^-40) lands in the subnormal range
    assert row[Stat.ZEROS].item() == 0 and row[Stat.POSINF].item() == 0
    narrowed = reference_row(x.float())
    assert narrowed[e4].item() == 0 and narrowed[Stat.POSINF].item() == 1
    assert narrowed[Stat.ZEROS].item() == 1 and narrowed[e4 + 1].item() == 1


@pytest.mark.interpreter
def test_float32_inputs_are_compared_in_float32():
    # y = |x * s| rounded to float32: x * s is above E4M3's max in float64 but rounds to it
    s = 1.0 / 3.0
    s32 = float(np.float32(s))
    x32 = np.nextafter(np.float32(448.0 / s32), np.float32(INF), dtype=np.float32)
    while float(np.float32(x32 * np.float32(s32))) > 448.0:
        x32 = np.nextafter(x32, np.float32(0), dtype=np.float32)
    assert float(x32) * s32 > 448.0 and float(np.float32(x32 * np.float32(s32))) == 448.0
    x = torch.tensor([float(x32)] * 3, dtype=torch.float32)
    row = reference_row(x, s)
    assert row[FMT_BASE[ROW_FORMATS[0]]].item() == 0
    assert_rows_match(triton_row(x, s), row)
