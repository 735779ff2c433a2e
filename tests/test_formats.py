"""Format constants and the overflow/underflow/subnormal definitions, checked against torch's
own casts (for fp8: every one of the 256 bit patterns)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stabilitywatch.formats import (FORMATS, Fmt, count_overflow, count_subnormal,
                                    count_underflow, scale_for, spec)

FP8 = [Fmt.E4M3, Fmt.E5M2]
CAST_FORMATS = [Fmt.E4M3, Fmt.E5M2, Fmt.FP16, Fmt.BF16]
IDS = lambda f: f.value  # noqa: E731


def all_fp8_values(fmt: Fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """(bits as int64, values as float32) for all 256 bit patterns."""
    bits = torch.arange(256, dtype=torch.int64)
    vals = bits.to(torch.uint8).view(FORMATS[fmt].torch_dtype).float()
    return bits, vals


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(torch.float32)


def ulps_around(v: float, k: int) -> torch.Tensor:
    """v and the k float32 neighbours on either side (positive v)."""
    c = f32([v])
    bits = c.view(torch.int32) + torch.arange(-k, k + 1, dtype=torch.int32)
    out = bits.view(torch.float32)
    return out[out > 0]


def probe_values(centre: float, seed: int) -> torch.Tensor:
    """Values around a threshold: float32 neighbours, a log-uniform spread over +-8 binades and
    over [2^-30, 2^-5], both signs, plus zero."""
    g = torch.Generator().manual_seed(seed)
    near = ulps_around(centre, 40)
    wide = centre * torch.exp2(torch.empty(4000, dtype=torch.float64).uniform_(-8, 8, generator=g))
    fixed = torch.exp2(torch.empty(4000, dtype=torch.float64).uniform_(-30, -5, generator=g))
    pos = torch.cat([near, wide.float(), fixed.float(), f32([centre * 0.75, centre * 1.5])])
    return torch.cat([pos, -pos, torch.zeros(2)])


# ---- constants ----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FP8, ids=IDS)
def test_fp8_constants_match_every_bit_pattern(fmt):
    f = FORMATS[fmt]
    bits, vals = all_fp8_values(fmt)
    finite = vals.isfinite()
    pos = finite & (vals > 0)
    exp_field = (bits >> f.mantissa_bits) & ((1 << f.exponent_bits) - 1)
    assert vals[finite].max().item() == f.max
    assert vals[finite].min().item() == -f.max
    assert vals[pos].min().item() == f.min_subnormal
    assert vals[pos & (exp_field != 0)].min().item() == f.min_normal
    assert bool(vals.isinf().any()) == f.has_inf
    # 2**mantissa_bits - 1 positive subnormals; all finite values are multiples of min_subnormal
    assert int((pos & (exp_field == 0)).sum()) == 2**f.mantissa_bits - 1
    assert 1 + f.exponent_bits + f.mantissa_bits == 8
    assert torch.equal(torch.remainder(vals[finite].double(), f.min_subnormal),
                       torch.zeros(int(finite.sum()), dtype=torch.float64))
    fi = torch.finfo(f.torch_dtype)
    assert (fi.max, fi.smallest_normal) == (f.max, f.min_normal)
    assert fi.eps == 2.0**-f.mantissa_bits


@pytest.mark.parametrize("fmt", [Fmt.FP16, Fmt.BF16, Fmt.FP32], ids=IDS)
def test_wide_format_constants_match_finfo(fmt):
    f = FORMATS[fmt]
    fi = torch.finfo(f.torch_dtype)
    assert f.max == fi.max
    assert f.min_normal == fi.smallest_normal == fi.tiny
    assert f.mantissa_bits == round(-math.log2(fi.eps))
    assert f.min_subnormal == fi.smallest_normal * fi.eps
    assert 1 + f.exponent_bits + f.mantissa_bits == fi.bits
    assert f.has_inf
    assert torch.tensor(f.min_subnormal, dtype=torch.float64).to(f.torch_dtype).item() \
        == f.min_subnormal


def test_spec_lookup():
    assert spec("E4M3") is FORMATS[Fmt.E4M3]
    assert spec(Fmt.FP16) is FORMATS[Fmt.FP16]
    assert spec("e5m2").max == 57344.0
    with pytest.raises(ValueError) as err:
        spec("nope")
    msg = str(err.value)
    assert "'nope'" in msg and all(f.value in msg for f in Fmt)


# ---- definitions against the cast ----------------------------------------------------------

def assert_iff(count_fn, values: torch.Tensor, expected: torch.Tensor, fmt: Fmt, what: str):
    """count_fn counts exactly the values where `expected` is True."""
    yes, no = values[expected], values[~expected]
    assert yes.numel() > 0 and no.numel() > 0, "probe set misses one side"
    got_yes, got_no = int(count_fn(yes, fmt)), int(count_fn(no, fmt))
    if (got_yes, got_no) == (yes.numel(), 0):
        return
    bad_no = [v for v in no.tolist() if int(count_fn(f32([v]), fmt))][:5]
    bad_yes = [v for v in yes.tolist() if not int(count_fn(f32([v]), fmt))][:5]
    raise AssertionError(
        f"{fmt.value} {what}: counted {got_yes}/{yes.numel()} of the expected values and "
        f"{got_no} others; counted but should not: {bad_no}; missed: {bad_yes}")


@pytest.mark.parametrize("fmt", CAST_FORMATS, ids=IDS)
def test_underflow_matches_cast(fmt):
    f = FORMATS[fmt]
    x = probe_values(f.min_subnormal / 2, seed=1)
    x = torch.cat([x, ulps_around(f.min_subnormal, 5), ulps_around(1.5 * f.min_subnormal, 5)])
    cast = x.to(f.torch_dtype).float()
    expected = (x != 0) & (cast == 0)
    assert_iff(count_underflow, x, expected, fmt, "underflow")
    # the exact half-way value ties to zero, the next float32 above survives
    half = f32([f.min_subnormal / 2])
    assert int(count_underflow(half, fmt)) == 1
    assert int(count_underflow(ulps_around(f.min_subnormal / 2, 1)[2:], fmt)) == 0


@pytest.mark.parametrize("fmt", CAST_FORMATS, ids=IDS)
def test_overflow_matches_cast(fmt):
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(2)
    spread = f.max * torch.exp2(torch.empty(3000, dtype=torch.float64).uniform_(-3, 3, generator=g))
    pos = torch.cat([ulps_around(f.max, 40), spread.float(),
                     f32([f.max * 2, 1e30, torch.finfo(torch.float32).max])])
    x = torch.cat([pos, -pos])
    x = x[x.isfinite()]
    over = x.abs() > f.max
    cast = x.to(f.torch_dtype).float()
    # above max: the cast gives Inf/NaN or saturates at +-max; at or below: finite, within max
    assert bool((~cast[over].isfinite() | (cast[over].abs() == f.max)).all())
    assert bool((cast[~over].isfinite() & (cast[~over].abs() <= f.max)).all())
    assert_iff(count_overflow, x, over, fmt, "overflow")
    assert int(count_overflow(f32([f.max, -f.max]), fmt)) == 0
    specials = f32([math.inf, -math.inf, math.nan])
    assert int(count_overflow(specials, fmt)) == 0  # only finite values overflow


@pytest.mark.parametrize("fmt", CAST_FORMATS, ids=IDS)
def test_subnormal_matches_cast(fmt):
    f = FORMATS[fmt]
    x = torch.cat([probe_values(f.min_normal, seed=3), probe_values(f.min_subnormal / 2, seed=4),
                   ulps_around(f.min_normal - f.min_subnormal / 2, 20)])
    x = torch.cat([x, -x])
    cast = x.to(f.torch_dtype).float()
    expected = (cast != 0) & (cast.abs() < f.min_normal)
    assert_iff(count_subnormal, x, expected, fmt, "subnormal")


@pytest.mark.parametrize("fmt", CAST_FORMATS, ids=IDS)
def test_counts_ignore_nonfinite_and_zero(fmt):
    x = f32([math.nan, math.inf, -math.inf, 0.0, -0.0])
    assert [int(c(x, fmt)) for c in (count_overflow, count_underflow, count_subnormal)] == [0, 0, 0]


# ---- scales ---------------------------------------------------------------------------------

SCALES = [2.0**10, 2.0**-7, 1 / 3, 448 / 3.7, 1e-30]


@pytest.mark.parametrize("scale", SCALES, ids=["2^10", "2^-7", "third", "448/3.7", "1e-30"])
@pytest.mark.parametrize("fmt", [Fmt.E4M3, Fmt.E5M2, Fmt.FP16], ids=IDS)
def test_scaled_count_equals_count_of_scaled_tensor(fmt, scale):
    g = torch.Generator().manual_seed(5)
    mags = torch.exp2(torch.empty(20000).uniform_(-40, 20, generator=g))
    signs = torch.randint(0, 2, (20000,), generator=g) * 2 - 1
    t = torch.cat([mags * signs, f32([0.0, math.nan, math.inf, -math.inf])])
    for fn in (count_overflow, count_underflow, count_subnormal):
        assert int(fn(t, fmt, scale)) == int(fn(t * scale, fmt)), fn.__name__
    # low-precision input: the scale applies to the float32 upcast, as in the kernel
    tb = t.to(torch.bfloat16)
    for fn in (count_overflow, count_underflow, count_subnormal):
        assert int(fn(tb, fmt, scale)) == int(fn(tb.float() * scale, fmt)), fn.__name__


def test_scale_for():
    assert scale_for(2.0, "e4m3") == 224.0
    assert scale_for(2.0, "e4m3", margin=1) == 112.0
    assert scale_for(0.0, "e4m3") == 1.0
    assert scale_for(math.inf, "fp16") == 1.0
    assert scale_for(math.nan, "fp16") == 1.0


def test_counts_are_int64_tensors():
    t = torch.tensor(np.array([1e6, 1e-12, 1e-6], dtype=np.float32))
    c = count_overflow(t, "fp16")
    assert isinstance(c, torch.Tensor) and c.dtype == torch.int64 and c.dim() == 0
    assert (int(c), int(count_underflow(t, "fp16")), int(count_subnormal(t, "fp16"))) == (1, 1, 1)
