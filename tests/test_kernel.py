"""The Triton statistics kernel (under TRITON_INTERPRET=1 on the CPU) against the pure-torch
reference row, plus dispatch (accumulate, compute_row, flat_view)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rowcheck import assert_rows_match
from stabilitywatch.formats import FORMATS, Fmt
from stabilitywatch.kernels import dispatch
from stabilitywatch.kernels.stats_triton import launch_row_stats, triton_row
from stabilitywatch.stats.layout import N_STATS, Stat, init_row, init_row_tensor, merge_rows
from stabilitywatch.stats.reference import reference_row

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
INF, NAN = math.inf, math.nan
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
# the interpreter's numpy arithmetic warns when x * scale overflows to inf (as intended)
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.interpreter]


# ---- inputs ---------------------------------------------------------------------------------

def neighbours(v: float, dtype: torch.dtype) -> list[float]:
    """v rounded to dtype and its two neighbours in dtype (one ulp either side), as floats."""
    t = torch.tensor([v], dtype=torch.float32).to(dtype)
    if not (t.float().isfinite().all() and t.float().item() > 0):
        return [t.float().item()]
    bits = t.view(_INT_OF_WIDTH[t.element_size()]).to(torch.int64)
    nb = (bits + torch.tensor([-1, 0, 1])).to(_INT_OF_WIDTH[t.element_size()])
    return nb.view(dtype).float().tolist()


def edge_values(dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Each format's max, min normal, min subnormal, min_subnormal/2 and subnormal limit (at the
    given scale), one ulp of the input dtype around each, both signs."""
    vals = []
    for f in FORMATS.values():
        for thr in (f.max, f.min_normal, f.min_subnormal, f.underflow_threshold,
                    f.subnormal_limit):
            vals += neighbours(thr / scale, dtype)
    pos = torch.tensor(vals, dtype=torch.float32)
    return torch.cat([pos, -pos])


def content(kind: str, n: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0):
    """n values of a kind, in dtype (made in float32, then cast)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(n, generator=g)
    elif kind == "lognormal":
        x = torch.exp(8 * torch.randn(n, generator=g)) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    elif kind == "specials":
        x = torch.randn(n, generator=g)
        pick = torch.randint(0, 20, (n,), generator=g)
        for code, v in ((0, NAN), (1, INF), (2, -INF), (3, 0.0), (4, -0.0)):
            x = torch.where(pick == code, torch.tensor(v), x)
    elif kind == "subnormal":
        mins = torch.tensor([f.min_subnormal for f in FORMATS.values()], dtype=torch.float32)
        which = torch.randint(0, len(mins), (n,), generator=g)
        mant = torch.randint(1, 1024, (n,), generator=g).float()
        x = mins[which] * mant * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    elif kind == "edges":
        e = edge_values(dtype, scale)
        x = e.repeat(n // e.numel() + 1)[:n]
        x = x[torch.randperm(n, generator=g)]
    elif kind == "mixed":
        parts = [content(k, n, dtype, seed + i, scale).float()
                 for i, k in enumerate(("lognormal", "specials", "edges"))]
        x = torch.stack(parts, 1).reshape(-1)[:n]
    else:
        raise ValueError(kind)
    return x.to(torch.float32).to(dtype)


# shape id -> (base shape, op giving the tested tensor from the base)
SHAPES = {
    "0": ((0,), lambda b: b),
    "1": ((1,), lambda b: b),
    "127": ((127,), lambda b: b),
    "4097": ((4097,), lambda b: b),
    "98309": ((98309,), lambda b: b),  # several programs, several grid-stride steps
    "33x65T": ((65, 33), lambda b: b.T),
    "slice33x65": ((33, 195), lambda b: b[:, ::3]),
    "perm3d": ((5, 7, 9), lambda b: b.permute(2, 0, 1)),
}
CONTENTS = ["normal", "lognormal", "specials", "subnormal", "edges"]


def make(dtype: torch.dtype, shape_id: str, kind: str, seed: int = 0, scale: float = 1.0):
    base_shape, op = SHAPES[shape_id]
    n = int(np.prod(base_shape))
    return op(content(kind, n, dtype, seed, scale).reshape(base_shape))


def kernel_row(t: torch.Tensor, scale=1.0) -> torch.Tensor:
    return triton_row(dispatch.flat_view(t), scale)


# ---- kernel against the reference -----------------------------------------------------------

@pytest.mark.parametrize("kind", CONTENTS)
@pytest.mark.parametrize("shape_id", list(SHAPES))
@pytest.mark.parametrize("dname", list(DTYPES))
def test_kernel_matches_reference(dname, shape_id, kind):
    x = make(DTYPES[dname], shape_id, kind, seed=len(shape_id))
    assert_rows_match(kernel_row(x), reference_row(x), label=f"{dname} {shape_id} {kind}")


SCALES = {"float_third": 1 / 3, "float_2^8": 256.0,
          "tensor_3.7": torch.tensor(3.7), "tensor_f64_2^-12": torch.tensor(2.0**-12, dtype=torch.float64)}


@pytest.mark.parametrize("sname", list(SCALES))
@pytest.mark.parametrize("dname", list(DTYPES))
def test_kernel_matches_reference_with_scale(dname, sname):
    scale = SCALES[sname]
    x = make(DTYPES[dname], "4097", "mixed", seed=7, scale=float(scale))
    got, want = kernel_row(x, scale), reference_row(x, scale)
    assert_rows_match(got, want, label=f"{dname} scale {sname}")
    # the scale moves the format counts only
    expect = reference_row(x)
    expect[Stat.E4M3_OVERFLOW: Stat.HIST] = want[Stat.E4M3_OVERFLOW: Stat.HIST]
    assert_rows_match(got, expect, label=f"{dname} scale {sname} vs unscaled")


@pytest.mark.parametrize("fill", ["nan", "zero", "posinf"])
@pytest.mark.parametrize("dname", list(DTYPES))
def test_uniform_tensors(dname, fill):
    dtype, n = DTYPES[dname], 300
    value = {"nan": NAN, "zero": 0.0, "posinf": INF}[fill]
    x = torch.full((n,), value, dtype=torch.float32)
    if fill == "zero":
        x[::2] = -0.0
    x = x.to(dtype)
    got = kernel_row(x)
    assert_rows_match(got, reference_row(x), label=f"{dname} all-{fill}")
    expect = init_row()
    expect[Stat.NUMEL] = n
    bits = torch.tensor([value], dtype=dtype).float().view(torch.int32).item() & 0xFFFFFFFF
    bits = 0x7FC00000 if fill == "nan" else bits
    expect[Stat.BITS_LO] = n * (bits & 0xFFFF)
    expect[Stat.BITS_HI] = n * (bits >> 16) if fill != "zero" else (n // 2) * 0x8000  # -0.0 halves
    if fill == "zero":
        expect[[Stat.ZEROS]] = n
        expect[[Stat.MIN, Stat.MAX, Stat.ABSMAX]] = 0.0
    elif fill == "nan":
        expect[Stat.NAN] = n
    elif dname == "e4m3":  # no inf in e4m3: torch's cast saturates +inf to 448
        assert bool(x.float().eq(448).all())
        return
    else:
        expect[Stat.POSINF] = n
    assert_rows_match(got, expect, label=f"{dname} all-{fill} explicit")


@pytest.mark.parametrize("dname", list(FP8))
def test_every_fp8_bit_pattern(dname):
    dtype = FP8[dname]
    f = FORMATS[Fmt(dname)]
    x = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(dtype)
    got = triton_row(x)
    assert_rows_match(got, reference_row(x), sum_rtol=1e-15, label=f"{dname} all 256")
    assert got[Stat.MAX].item() == f.max and got[Stat.MIN].item() == -f.max
    assert got[Stat.ABSMIN_NZ].item() == f.min_subnormal and got[Stat.ZEROS].item() == 2
    assert got[Stat.NAN].item() == (2 if dname == "e4m3" else 6)
    assert got[Stat.POSINF].item() == got[Stat.NEGINF].item() == (0 if dname == "e4m3" else 1)
    # 16 patterns at a time: sums of so few fp8 values are exact in float64, so the decoded
    # value of every pattern is checked
    for k in range(16):
        chunk = x[16 * k: 16 * (k + 1)]
        assert_rows_match(triton_row(chunk), reference_row(chunk), sum_rtol=0.0,
                          label=f"{dname} bytes {16 * k}..{16 * k + 15}")


# ---- merging ---------------------------------------------------------------------------------

def test_two_launches_into_one_row_equal_merged_rows():
    a = make(torch.bfloat16, "4097", "mixed", seed=1)
    b = make(torch.float8_e5m2, "127", "specials", seed=2)
    row = init_row_tensor()
    launch_row_stats(dispatch.flat_view(a), row, 0.5)
    launch_row_stats(dispatch.flat_view(b), row, 0.5)
    want = merge_rows(torch.stack([reference_row(a, 0.5), reference_row(b, 0.5)]).numpy())
    assert_rows_match(row, want, label="launch a then b")


def test_dispatch_accumulate_triton_merges():
    parts = [make(DTYPES[d], s, "mixed", seed=i)
             for i, (d, s) in enumerate([("fp32", "33x65T"), ("fp16", "slice33x65"),
                                         ("e4m3", "perm3d"), ("bf16", "0")])]
    row = init_row_tensor()
    scale = torch.tensor(2.0)
    for p in parts:
        dispatch.accumulate(p, row, scale, backend="triton")
    want = merge_rows(torch.stack([reference_row(p, scale) for p in parts]).numpy())
    assert_rows_match(row, want, label="accumulate x4")


# ---- dispatch --------------------------------------------------------------------------------

@pytest.mark.parametrize("dname", list(DTYPES))
def test_compute_row_backends(dname):
    x = make(DTYPES[dname], "slice33x65", "mixed", seed=3)
    want = reference_row(x, 3.0)
    assert_rows_match(dispatch.compute_row(x, 3.0, backend="triton"), want, label="triton")
    # on the CPU "auto" is the CPU path (stats/cpu.py: the reference's numbers, sums to
    # rounding) and "torch" the reference itself, bit for bit
    from stabilitywatch.stats.cpu import cpu_row
    auto = dispatch.compute_row(x, 3.0)
    assert torch.equal(auto, torch.from_numpy(cpu_row(x, 3.0)))
    assert_rows_match(auto, want, label="auto")
    assert torch.equal(dispatch.compute_row(x, 3.0, backend="torch"), want)


def test_compute_row_falls_back_for_float64_and_rejects_int():
    x = torch.tensor([1e300, -1e-310, 0.0, NAN], dtype=torch.float64)
    assert torch.equal(dispatch.compute_row(x, backend="triton"), reference_row(x))
    with pytest.raises(TypeError):
        dispatch.compute_row(torch.arange(5), backend="triton")


def test_empty_inputs_leave_row_unchanged():
    row = init_row_tensor()
    dispatch.accumulate(torch.empty(0, 3), row, backend="triton")
    launch_row_stats(torch.empty(0), row)
    assert_rows_match(row, init_row(), sum_rtol=0.0)
    assert row.shape == (N_STATS,)


def _same_elements(flat: torch.Tensor, t: torch.Tensor) -> bool:
    return flat.dim() == 1 and flat.is_contiguous() and torch.equal(
        flat.float().sort().values, t.reshape(-1).float().sort().values)


@pytest.mark.parametrize("case", ["contiguous", "transposed", "permuted3d", "channels_last",
                                  "offset_transposed", "size1_dims"])
def test_flat_view_dense_is_not_a_copy(case):
    base = torch.randn(6, 5, 4, 3)
    t = {"contiguous": base,
         "transposed": base[0, 0].T,
         "permuted3d": base[1].permute(2, 0, 1),
         "channels_last": base.contiguous(memory_format=torch.channels_last),
         "offset_transposed": base.reshape(30, 12)[7:19].T,
         "size1_dims": base[2:3].permute(3, 1, 0, 2)}[case]
    flat = dispatch.flat_view(t)
    assert flat.data_ptr() == t.data_ptr() and flat.numel() == t.numel()
    assert _same_elements(flat, t)


@pytest.mark.parametrize("case", ["strided_slice", "expanded", "row_slice_transposed"])
def test_flat_view_with_gaps_copies(case):
    base = torch.randn(33, 195)
    t = {"strided_slice": base[:, ::3], "expanded": torch.randn(1, 7).expand(5, 7),
         "row_slice_transposed": base[:, 10:20].T}[case]
    flat = dispatch.flat_view(t)
    assert flat.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert _same_elements(flat, t)


# ---- property test -----------------------------------------------------------------------------

_specials = st.sampled_from([0.0, -0.0, NAN, INF, -INF, 2.0**-149, 448.0, 449.0, 65504.0,
                             65520.0, 2.0**-25, 2.0**-10, 2.0**-17, 57344.0, 3e38])
_floats = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True), _specials)


@settings(max_examples=30, deadline=None)
@given(arr=hnp.arrays(np.float32, st.integers(0, 600), elements=_floats),
       scale=st.sampled_from([1.0, 0.1, 3.0, 2.0**-20, 2.0**30]))
def test_kernel_matches_reference_random(arr, scale):
    x = torch.from_numpy(arr)
    assert_rows_match(triton_row(x, scale), reference_row(x, scale), label=f"scale {scale}")


@pytest.mark.parametrize("dname", list(DTYPES))
def test_fingerprint_values_and_single_bit_flip(dname):
    dtype = DTYPES[dname]
    x = torch.tensor([1.0, -2.0, float("nan"), 0.5] * 40, dtype=torch.float32).to(dtype)
    row = kernel_row(x)
    hi = 40 * (0x3F80 + 0xC000 + 0x7FC0 + 0x3F00)
    assert (row[Stat.BITS_LO].item(), row[Stat.BITS_HI].item()) == (0.0, float(hi))
    flipped = x.clone()
    raw = flipped.view(torch.uint8 if dtype.itemsize == 1 else
                       {2: torch.int16, 4: torch.int32}[dtype.itemsize])
    raw[7] ^= 1  # lowest bit of one value (0.5 -> its neighbour)
    other = kernel_row(flipped)
    assert (other[Stat.BITS_LO], other[Stat.BITS_HI]) != (row[Stat.BITS_LO], row[Stat.BITS_HI])
    assert_rows_match(other, reference_row(flipped))
