"""The CPU path (stats/cpu.py) field by field against the reference (stats/reference.py): every
test runs twice, once on the numpy passes and once on the compiled loops (stats/cpu_jit.py)."""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from rowcheck import assert_rows_match
from stabilitywatch.formats import FORMATS, ROW_FORMATS
from stabilitywatch.kernels import dispatch
from stabilitywatch.stats import cpu, cpu_jit
from stabilitywatch.stats.buffer import StatsBuffer
from stabilitywatch.kernels.backend import tensor_stats
from stabilitywatch.kernels.backend import kernel_backend
from stabilitywatch.stats.layout import (HIST_EMIN, N_STATS, Stat, init_row, init_row_tensor,
                                         merge_into)
from stabilitywatch.stats.reference import reference_row

INF, NAN = math.inf, math.nan


@pytest.fixture(autouse=True, params=["numpy", "compiled"])
def path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(cpu_jit, "ENABLED", False)
    else:
        if not cpu_jit.ENABLED:
            pytest.skip("numba is not installed (or STABILITYWATCH_CPU_JIT=0): no compiled loops")
        assert cpu_jit.wait(), "the compiled loops did not compile within the wait"
    return request.param
DTYPES = [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16),
          ("fp64", torch.float64), ("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)]


def edges() -> list[float]:
    # every format threshold, the floats next to it, and both signs
    out = []
    for fmt in ROW_FORMATS:
        f = FORMATS[fmt]
        for v in (f.max, f.underflow_threshold, f.subnormal_limit, f.min_normal, f.min_subnormal):
            v32 = np.float32(v)
            out += [float(v32), float(np.nextafter(v32, np.float32(INF))),
                    float(np.nextafter(v32, np.float32(0)))]
    return out + [-v for v in out] + [2.0**-149, 2.0**-126, 3e38, 2.0**-97, 2.0**31]


def sample(kind: str, dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n + len(kind))
    if kind == "bits" and dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.arange(256).to(torch.uint8).view(dtype)
    if kind == "bits" and dtype in (torch.bfloat16, torch.float16):
        return torch.randint(0, 1 << 16, (n,), generator=g).to(torch.int16).view(dtype)
    if kind == "bits":
        return torch.randint(-(1 << 31), 1 << 31, (n,), generator=g, dtype=torch.int64).to(
            torch.int32).view(torch.float32).to(dtype)
    x = torch.exp(12 * torch.randn(n, generator=g, dtype=torch.float64))
    x = x * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    if kind == "specials":
        e = torch.tensor(edges(), dtype=torch.float64)
        m = min(n, e.numel())
        x[:m] = e[:m]
        x[m::7], x[m + 1::11], x[m + 2::13], x[m + 3::17], x[m + 4::19] = NAN, INF, -INF, 0.0, -0.0
    return x.to(dtype)


@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**-12, 0.0, INF, NAN, -3.0, 1e-40],
                         ids=["s1", "s0.37", "s2^-12", "s0", "sinf", "snan", "s-3", "s1e-40"])
@pytest.mark.parametrize("kind", ["randn", "specials", "bits"])
@pytest.mark.parametrize("dname,dtype", DTYPES, ids=[d for d, _ in DTYPES])
def test_cpu_row_matches_reference(dname, dtype, kind, scale):
    x = sample(kind, dtype, 4097)
    assert_rows_match(cpu.cpu_row(x, scale), reference_row(x, scale),
                      label=f"{dname} {kind} scale={scale}")


def _shapes(dtype):
    g = torch.Generator().manual_seed(3)
    base = (torch.randn(67, 33, generator=g) * 40).to(dtype)
    return {
        "empty": torch.zeros(0, 5, dtype=dtype),
        "0-dim": torch.tensor(-2.5).to(dtype),
        "one": torch.tensor([0.0]).to(dtype),
        "odd": (torch.randn(127, generator=g) * 1e3).to(dtype),
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "chunks": (torch.randn(3 * cpu.CHUNK + 5, generator=g) * 1e-3).to(dtype),
        "chunks-strided": (torch.randn(cpu.CHUNK + 7, 2, generator=g)).to(dtype)[:, 1],
    }


@pytest.mark.parametrize("shape", ["empty", "0-dim", "one", "odd", "transposed", "strided",
                                   "chunks", "chunks-strided"])
@pytest.mark.parametrize("dname,dtype", DTYPES, ids=[d for d, _ in DTYPES])
def test_cpu_row_on_awkward_shapes(dname, dtype, shape):
    x = _shapes(dtype)[shape]
    assert_rows_match(cpu.cpu_row(x, 1.0), reference_row(x, 1.0), merged=shape.startswith("chunks"),
                      label=f"{dname} {shape}")
    assert_rows_match(cpu.cpu_row(x, 7.0), reference_row(x, 7.0), merged=shape.startswith("chunks"),
                      label=f"{dname} {shape} scale 7")


def test_negative_bit_view_and_tensor_scale():
    z = torch.complex(torch.randn(300), torch.randn(300) * 1e5)
    x = z.conj().imag          # the negative bit set: memory holds the values un-negated
    assert x.is_neg()
    assert_rows_match(cpu.cpu_row(x), reference_row(x), label="neg view")
    s = torch.tensor(1e-3)
    assert_rows_match(cpu.cpu_row(x, s), reference_row(x, s), label="tensor scale")
    with pytest.raises(TypeError, match="int64"):
        cpu.cpu_row(torch.arange(3))
    assert np.array_equal(cpu.cpu_row(torch.zeros(0)), init_row(), equal_nan=True)


def test_batched_rows_match_one_tensor_at_a_time():
    g = torch.Generator().manual_seed(5)
    ts, scales = [], []
    for i in range(60):
        dtype = DTYPES[i % len(DTYPES)][1]
        n = [1, 3, 128, 1000, cpu.SMALL, cpu.SMALL + 1, 40000][i % 7]
        x = torch.exp(6 * torch.randn(n, generator=g)) * (i - 30)
        if i % 5 == 0:
            x[:: 9] = NAN
            x[1:: 10] = -INF
        ts.append(x.to(dtype))
        scales.append([1.0, 1.0, 0.25][i % 3])
    rows = cpu.cpu_rows(ts, scales)
    assert rows.shape == (len(ts), N_STATS)
    for i, (t, s) in enumerate(zip(ts, scales)):
        assert_rows_match(rows[i], reference_row(t, s), label=f"tensor {i} {t.dtype} {t.numel()}")


@pytest.mark.parametrize("nseg", [3, 20, cpu.FEW_SEGMENTS, cpu.FEW_SEGMENTS + 1, 80])
@pytest.mark.parametrize("dname,dtype", [DTYPES[0], DTYPES[1], DTYPES[3]],
                         ids=["fp32", "bf16", "fp64"])
def test_one_batch_of_many_segments_with_and_without_non_finite_values(dname, dtype, nseg):
    # the sums take per-segment dots up to FEW_SEGMENTS segments, whole-array passes beyond:
    # both against the reference, with NaN/Inf in some segments (their sums skip them) and a
    # first element (the shift) that is zero or not finite in others
    g = torch.Generator().manual_seed(nseg)
    ts = []
    for i in range(nseg):
        x = torch.randn(7 + 53 * (i % 9), generator=g, dtype=torch.float64) * 10.0 ** (i % 5 - 2)
        if i % 4 == 1:
            x[2::5] = NAN
            x[3::7] = INF
        if i % 6 == 2:
            x[0] = 0.0 if i % 12 == 2 else -INF
        ts.append(x.to(dtype))
    rows = cpu.cpu_rows(ts, [1.0] * nseg)
    for i, t in enumerate(ts):
        assert_rows_match(rows[i], reference_row(t), label=f"segment {i} of {nseg} {dname}")


def test_merge_host_is_merge_into():
    g = torch.Generator().manual_seed(9)
    parts = [torch.randn(n, generator=g) * 10 + 3 for n in (5, 1, 300, 70)]
    parts[2][4] = INF
    dst_t = init_row_tensor("cpu")
    dst_n = init_row().reshape(1, -1)
    for p in parts:
        merge_into(dst_t, reference_row(p))
        cpu.merge_host(dst_n, reference_row(p).numpy().reshape(1, -1))
    np.testing.assert_array_equal(dst_n[0], dst_t.numpy())


def test_accumulate_each_merges_rows_written_twice():
    g = torch.Generator().manual_seed(2)
    ts = [torch.randn(n, generator=g) * (n + 1) for n in (10, 200, 31, 4, 90000)]
    rows = init_row_tensor("cpu", 3)
    slots = [0, 2, 0, 1, 0]
    dispatch.accumulate_each([(t, rows, s, 1.0) for t, s in zip(ts, slots)])
    for slot in range(3):
        mine = [t for t, s in zip(ts, slots) if s == slot]
        assert_rows_match(rows[slot], reference_row(torch.cat(mine)), merged=len(mine) > 1,
                          label=f"slot {slot}")


def test_buffer_add_many_on_cpu_matches_add():
    g = torch.Generator().manual_seed(4)
    items = [((torch.randn(n, generator=g) * 3).to(dt), f"m{i}", "weight", s)
             for i, (n, dt, s) in enumerate([(16, torch.float32, 1.0), (300, torch.bfloat16, 1.0),
                                            (7, torch.float16, 2.0), (5000, torch.float32, 1.0),
                                            (1, torch.float64, 1.0)])]
    frames = []
    for many in (True, False):
        buf = StatsBuffer(kernel_backend("auto"))
        for step in range(2):   # the second step takes the kept plan
            buf.begin_step(step)
            if many:
                buf.add_many(items, phase=1)
            else:
                for t, m, r, s in items:
                    buf.add(t, m, r, 1, s)
            buf.end_step()
        frames.append(buf.poll(block=True))
    for fm, fa in zip(*frames):
        assert fm.keys == fa.keys
        np.testing.assert_allclose(fm.rows, fa.rows, rtol=1e-12, atol=0)


def test_tensor_stats_on_cpu_takes_the_cpu_path(monkeypatch):
    x = torch.randn(1000) * 5
    want = tensor_stats(x, 3.0)

    def refuse(*a, **k):
        raise AssertionError("the reference ran for a CPU tensor")

    monkeypatch.setattr(dispatch, "reference_row", refuse)
    got = tensor_stats(x, 3.0)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-12, nan_ok=True), key
    with pytest.raises(AssertionError, match="reference ran"):
        dispatch.accumulate(x, init_row_tensor("cpu"), 1.0, backend="torch")


def test_threads_keep_their_own_scratch():
    xs = [torch.randn(cpu.CHUNK - i, generator=torch.Generator().manual_seed(i)) * (i + 1)
          for i in range(4)]
    want = [reference_row(x) for x in xs]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                assert_rows_match(cpu.cpu_row(xs[i]), want[i], label=f"thread {i}")
        except AssertionError as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in 60 s"
    assert not errors, errors[0]


def test_counts_exact_past_2_pow_24():
    n = 2**24 + 3   # not representable in float32: a float32 count would stick at 2**24
    x = torch.full((n + 5,), 1000.0, dtype=torch.bfloat16)  # 1000 > e4m3 max
    x[-5:] = torch.tensor([0.0, -0.0, 0.0, NAN, -INF])
    row = cpu.cpu_row(x)
    assert row[Stat.NUMEL] == n + 5
    assert (row[Stat.ZEROS], row[Stat.NAN], row[Stat.NEGINF]) == (3, 1, 1)
    assert row[Stat.E4M3_OVERFLOW] == n
    assert row[Stat.E5M2_OVERFLOW] == row[Stat.FP16_OVERFLOW] == 0
    assert row[Stat.HIST + (9 - HIST_EMIN)] == n  # floor(log2 1000) == 9
    assert row[Stat.SUM] == 1000.0 * n
    assert row[Stat.SUMSQ] == 1e6 * n


def _one_frame(buf, step, adds):
    buf.begin_step(step)
    for t, m, s, over in adds:
        buf.add(t, m, "output", 2, scale=s, overwrite=over)
    buf.end_step()
    return buf.poll(block=True)[-1]


def test_small_cpu_tensors_are_read_together_with_the_values_they_had_when_added():
    # add() holds small CPU tensors' values and reads them at the step's end: a tensor changed
    # in place after its add() (an in-place activation after a hook) keeps the added values
    g = torch.Generator().manual_seed(8)
    ts = [(torch.randn(n, generator=g) * 4).to(dt) for n, dt in
          [(30, torch.float32), (5, torch.bfloat16), (cpu.SMALL, torch.float16), (1, torch.float64),
           (cpu.SMALL + 1, torch.float32), (300, torch.float32)]]
    want = [reference_row(t, 1.0 if i != 5 else 0.5) for i, t in enumerate(ts)]
    first = ts[0].clone()
    buf = StatsBuffer(kernel_backend("auto"))
    buf.begin_step(0)
    for i, t in enumerate(ts):
        buf.add(t, f"m{i}", "output", 2, scale=1.0 if i != 5 else 0.5)
    assert buf._stage.held
    for t in ts:
        t.mul_(-3)
    buf.add(ts[0], "m0", "output", 2)              # the same row again: both merge
    buf.end_step()
    frame = buf.poll(block=True)[0]
    assert frame.keys == [(f"m{i}", "output") for i in range(len(ts))]
    for i in range(1, len(ts)):
        assert_rows_match(frame.rows[i], want[i], label=f"m{i}")
    both = torch.cat([first, ts[0]])
    assert_rows_match(frame.rows[0], reference_row(both), merged=True, label="m0 twice")


def test_held_rows_and_overwrite_and_a_full_stage():
    g = torch.Generator().manual_seed(12)
    a, b = torch.randn(100, generator=g), torch.randn(40, generator=g) * 9
    buf = StatsBuffer(kernel_backend("auto"))
    f = _one_frame(buf, 0, [(a, "m", 1.0, True), (b, "m", 1.0, True)])   # the last write wins
    assert_rows_match(f.rows[0], reference_row(b), label="overwrite")
    many = [torch.randn(cpu.SMALL, generator=g) for _ in range(2 * cpu.CHUNK // cpu.SMALL + 1)]
    f = _one_frame(buf, 1, [(t, f"x{i}", 1.0, False) for i, t in enumerate(many)])
    for i, t in enumerate(many):
        assert_rows_match(f.rows[f.index(f"x{i}", "output")], reference_row(t), label=f"x{i}")


@pytest.mark.parametrize("dname,dtype", DTYPES[:4], ids=[d for d, _ in DTYPES[:4]])
def test_batched_rows_with_values_at_the_thresholds(dname, dtype):
    # small tensors read in one batch, some holding values exactly at a format threshold (or
    # next to it: the same exponent), some none: the counts of each come from its own values
    e = torch.tensor(edges())
    g = torch.Generator().manual_seed(11)
    ts = []
    for i in range(24):
        x = torch.randn(50 + 37 * i, generator=g) * 1e-3
        if i % 3:
            pick = torch.randint(0, e.numel(), (1 + i,), generator=g)
            x[: pick.numel()] = e[pick]
        if i % 4 == 0:
            x[-3:] = 0.0
        ts.append(x.to(dtype))
    rows = cpu.cpu_rows(ts, [1.0] * len(ts))
    for i, t in enumerate(ts):
        assert_rows_match(rows[i], reference_row(t), label=f"tensor {i} {dname}")


@pytest.mark.parametrize("lowest", ["subnormal", "tiny-normal", "zeros-only", "dense"])
@pytest.mark.parametrize("dname,dtype", DTYPES, ids=[d for d, _ in DTYPES])
def test_smallest_nonzero_of_one_tensor_whatever_its_lowest_exponent_holds(dname, dtype, lowest):
    # one tensor: the smallest nonzero |x| is looked for in its lowest occupied exponent field,
    # alone when that field holds few values; zeros share field 0 with the subnormals
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(4096, generator=g, dtype=torch.float64) * 3).to(dtype)
    tiny = torch.finfo(dtype).tiny
    if lowest == "subnormal":
        x[7], x[8], x[9] = 0.0, -tiny / 4, tiny / 2   # -0.0 and +0.0 below them
        x[10] = -0.0
    elif lowest == "tiny-normal":
        x[100], x[200] = -tiny * 1.5, tiny * 1.25
    elif lowest == "zeros-only":
        x[:] = 0.0
        x[3] = -0.0
    else:
        x[:] = 1.5
        x[::5] = -1.75
    assert_rows_match(cpu.cpu_row(x), reference_row(x), label=f"{dname} {lowest}")
