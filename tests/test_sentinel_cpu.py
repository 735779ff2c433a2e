"""The sentinel of CPU gradients in numpy (stats/sentinel_cpu.py) field by field against the
pure-torch twin (stats/sentinel.py): awkward shapes, every floating dtype, NaN/Inf anywhere,
huge finite values, counts past 2^24; and the store reading CPU gradients through it."""
from __future__ import annotations

import math

import pytest
import torch

from stabilitywatch.stats import sentinel_cpu
from stabilitywatch.stats.sentinel import C_ABSMAX, C_NAN, C_NONFINITE, C_SUMSQ, sentinel_reference
from stabilitywatch.stats.sentinel_cpu import DOT, sentinel_host
from stabilitywatch.stats.sentinel_store import SentinelStore
from stabilitywatch.kernels.backend import kernel_backend

NAN, INF = math.nan, math.inf
DTYPES = [("f32", torch.float32), ("bf16", torch.bfloat16), ("f16", torch.float16),
          ("f64", torch.float64), ("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)]


def _check(grads, slots, rows):
    ref = torch.zeros(rows, 4, dtype=torch.float64)
    got = torch.zeros(rows, 4, dtype=torch.float64)
    sentinel_reference(grads, ref, slots)
    sentinel_host(grads, got, slots)
    for s in range(rows):
        r, g = ref[s].tolist(), got[s].tolist()
        for c in (C_NONFINITE, C_ABSMAX, C_NAN):      # counts and extrema: exact
            assert g[c] == r[c], (s, c, g, r)
        assert g[C_SUMSQ] == pytest.approx(r[C_SUMSQ], rel=1e-12, abs=0), (s, g, r)
    return got


def _shapes(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(67, 33, generator=g) * 40
    big = torch.randn(3 * DOT + 5, generator=g) * 1e-3
    return {
        "0-dim": torch.tensor(-2.5),
        "one": torch.tensor([0.0]),
        "odd": torch.randn(127, generator=g) * 1e3,
        "4097": torch.randn(4097, generator=g),
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "chunks": big,
        "chunks-strided": torch.randn(DOT + 7, 2, generator=g)[:, 1],
        "negative": -torch.rand(300, generator=g) - 0.5,
        "zeros": torch.zeros(50),
        "empty": torch.zeros(0, 4),
    }, dtype


def _to(t, dtype):
    # fp8 casts saturate nothing: keep the values inside e4m3's range so none turns NaN
    return (t.clamp(-400, 400) if dtype == torch.float8_e4m3fn else t).to(dtype)


@pytest.mark.parametrize("dname,dtype", DTYPES, ids=[d for d, _ in DTYPES])
def test_clean_gradients_match_the_twin(dname, dtype):
    shapes, _ = _shapes(dtype)
    grads = [_to(t, dtype) for t in shapes.values()]
    slots = list(range(len(grads)))[::-1]
    got = _check(grads, slots, len(grads))
    assert got[:, C_NONFINITE].sum() == 0 and got[:, C_SUMSQ].min() >= 0


@pytest.mark.parametrize("dname,dtype", DTYPES, ids=[d for d, _ in DTYPES])
@pytest.mark.parametrize("where", ["first", "last", "second-chunk", "all-nan", "all-inf", "mixed"])
def test_nan_and_inf_anywhere_match_the_twin(dname, dtype, where):
    g = torch.Generator().manual_seed(7)
    t = torch.randn(2 * DOT + 11, generator=g) * 5
    if where == "first":
        t[0] = NAN
    elif where == "last":
        t[-1] = -INF
    elif where == "second-chunk":
        t[DOT + 3] = INF
        t[DOT + 9] = NAN
    elif where == "all-nan":
        t[:] = NAN
    elif where == "all-inf":
        t[::2], t[1::2] = INF, -INF
    else:
        t[::5], t[1::7], t[2::11] = NAN, INF, -INF
    if dtype == torch.float8_e4m3fn:   # no Inf in e4m3 (casts saturate): NaN stands in
        t = torch.where(t.isinf(), NAN, t.clamp(-400, 400))
    x = t.to(dtype)
    strided = torch.stack([x, x], 1)[:, 0]
    got = _check([x, strided, x[:1]], [0, 1, 2], 3)
    assert got[0, C_NONFINITE] > 0
    assert got[0, [0, 1, 3]].tolist() == got[1, [0, 1, 3]].tolist()


def test_huge_finite_values_keep_their_squares():
    # 2^100 is finite in float32 and bf16, its square only in float64
    for dtype in (torch.float32, torch.bfloat16):
        big = torch.full((300,), 2.0 ** 100).to(dtype)
        got = _check([big], [0], 1)
        assert got[0, C_SUMSQ].item() == pytest.approx(300 * 2.0 ** 200, rel=1e-12)
        assert got[0, C_NONFINITE] == 0 and got[0, C_ABSMAX] == 2.0 ** 100


def test_rows_accumulate_and_keep_the_larger_absmax():
    a, b = torch.tensor([1.0, -3.0]), torch.tensor([2.0, NAN])
    out = torch.zeros(1, 4, dtype=torch.float64)
    sentinel_host([a], out, [0])
    sentinel_host([b], out, [0])
    assert out[0].tolist() == [1.0, 3.0, 1.0 + 9.0 + 4.0, 1.0]


def test_counts_past_2_to_the_24_stay_exact():
    # a float32 count stops at 16,777,216: 2^24 + 7 NaN (a stride-0 view: read chunk by chunk,
    # nothing materialised) and 2^24 + 3 Inf among finite values in one contiguous tensor
    n = (1 << 24) + 7
    nan = torch.tensor([NAN]).expand(n)
    inf = torch.ones((1 << 24) + 10)
    inf[:(1 << 24) + 3] = INF
    out = torch.zeros(2, 4, dtype=torch.float64)
    sentinel_host([nan, inf], out, [0, 1])
    assert out[0].tolist() == [float(n), 0.0, 0.0, float(n)]
    assert out[1].tolist() == [float((1 << 24) + 3), 1.0, 7.0, 0.0]


def test_the_store_reads_cpu_gradients_in_numpy(monkeypatch):
    calls = []
    real = sentinel_cpu.sentinel_host
    monkeypatch.setattr("stabilitywatch.stats.sentinel_store.sentinel_host",
                        lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(n, generator=g) for n in (5, 300, 4097)]
    grads[1][7] = NAN
    results = {}
    for name in ("auto", "torch"):
        store = SentinelStore(kernel_backend(name))
        store.set_keys([("m", f"g{k}") for k in range(3)])
        store.write([(k, t) for k, t in enumerate(grads)])
        results[name] = store.frame(store.end_step(0))
    assert calls == [1]                       # "auto" went through numpy, "torch" did not
    a, t = results["auto"], results["torch"]
    assert a.nonfinite.tolist() == t.nonfinite.tolist() == [0.0, 1.0, 0.0]
    assert a.absmax.tolist() == t.absmax.tolist() and a.nan.tolist() == t.nan.tolist()
    assert a.sumsq.tolist() == pytest.approx(t.sumsq.tolist(), rel=1e-12)
