"""The compiled Triton kernel on a CUDA GPU against the reference (run with
STABILITYWATCH_REAL_TRITON=1 so that conftest leaves the interpreter off)."""
from __future__ import annotations

import math
import os

import pytest
import torch

from rowcheck import assert_rows_match
from stabilitywatch.formats import FORMATS
from stabilitywatch.stats.layout import Stat, init_row_tensor, merge_rows
from stabilitywatch.stats.reference import reference_row

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="the Triton interpreter is on: set STABILITYWATCH_REAL_TRITON=1"),
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SIZES = {"1": 1, "127": 127, "4097": 4097, "1M+3": 2**20 + 3, "2^26": 2**26}


def gpu_values(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Wide magnitudes with NaN/Inf, zeros, and every format's thresholds sprinkled in."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.exp(8 * torch.randn(n, device="cuda", generator=g))
    x = x * (torch.randint(0, 2, (n,), device="cuda", generator=g) * 2 - 1)
    edges = []
    for f in FORMATS.values():
        edges += [f.max, f.min_normal, f.min_subnormal, f.underflow_threshold, f.subnormal_limit]
    specials = torch.tensor(edges + [-e for e in edges] + [math.nan, math.inf, -math.inf, 0.0],
                            device="cuda")
    k = min(n, specials.numel())
    pos = torch.randperm(n, device="cuda", generator=g)[:k]
    x[pos] = specials[:k]
    return x.to(dtype)


@pytest.mark.parametrize("sname", list(SIZES))
@pytest.mark.parametrize("dname", list(DTYPES))
def test_gpu_kernel_matches_reference(dname, sname):
    from stabilitywatch.kernels.stats_triton import triton_row

    x = gpu_values(SIZES[sname], DTYPES[dname], seed=SIZES[sname] % 1000)
    got = triton_row(x)
    assert got.device.type == "cuda"
    assert_rows_match(got, reference_row(x), sum_rtol=1e-12, label=f"cuda {dname} {sname}")
    got_s = triton_row(x, torch.tensor(448.0 / 3, device="cuda"))
    assert_rows_match(got_s, reference_row(x, 448.0 / 3), sum_rtol=1e-12,
                      label=f"cuda {dname} {sname} scaled")


def test_gpu_counts_exact_past_2_pow_24():
    from stabilitywatch.kernels.stats_triton import triton_row

    n = 2**26 + 3
    x = torch.full((n,), 1000.0, dtype=torch.bfloat16, device="cuda")
    x[-3:] = 0
    row = triton_row(x).cpu()
    assert row[Stat.NUMEL].item() == n and row[Stat.ZEROS].item() == 3
    assert row[Stat.E4M3_OVERFLOW].item() == n - 3
    assert row[Stat.SUM].item() == 1000.0 * (n - 3)


def test_gpu_accumulate_merges_and_dense_views():
    from stabilitywatch.kernels import dispatch

    a = gpu_values(65 * 33, torch.bfloat16, 1).reshape(65, 33).T
    b = gpu_values(33 * 195, torch.float8_e5m2, 2).reshape(33, 195)[:, ::3]
    row = init_row_tensor("cuda")
    dispatch.accumulate(a, row, backend="triton")
    dispatch.accumulate(b, row, backend="auto")
    want = merge_rows(torch.stack([reference_row(a), reference_row(b)]).cpu().numpy())
    assert_rows_match(row, want, label="cuda accumulate")


def test_gpu_launch_has_no_host_sync():
    from stabilitywatch.kernels import dispatch
    from stabilitywatch.kernels.stats_triton import launch_row_stats

    xs = [gpu_values(100_003, d, i) for i, d in enumerate(DTYPES.values())]
    perm = gpu_values(4 * 5 * 6, torch.float16, 9).reshape(4, 5, 6).permute(2, 0, 1)
    scale = torch.tensor(0.25, device="cuda")
    rows = init_row_tensor("cuda", rows=len(xs) + 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, x in enumerate(xs):
            launch_row_stats(x, rows[i], scale if i % 2 else 2.0)
        dispatch.accumulate(perm, rows[-1], scale)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for i, x in enumerate(xs):
        assert_rows_match(rows[i], reference_row(x, scale if i % 2 else 2.0), label=f"sync {i}")
    assert_rows_match(rows[-1], reference_row(perm, scale), label="sync perm")


def test_gpu_kernel_is_deterministic_except_last_bits_of_sums():
    """Counts, extrema, fingerprint and histogram are identical run to run; the float64 sums
    are merged with atomics in varying order and may differ in the last bits."""
    import torch
    from stabilitywatch.kernels.stats_triton import triton_row
    from stabilitywatch.stats.layout import Stat
    x = (torch.randn(1 << 26, device="cuda") * 3).to(torch.bfloat16)
    rows = torch.stack([triton_row(x) for _ in range(5)])
    sum_fields = (Stat.SUM, Stat.SUMSQ, Stat.SHIFT_SUM, Stat.SHIFT_SUMSQ)
    exact = [i for i in range(rows.shape[1]) if i not in sum_fields]
    assert (rows[:, exact] == rows[0, exact]).all()
    sums = rows[:, [Stat.SUM, Stat.SUMSQ]]
    rel = ((sums - sums[0]).abs() / rows[0, Stat.SUMSQ]).max().item()
    # the shifted sums (SUM - n K, and the sum of (x - K)^2) spread as the plain ones do
    n, k = x.numel(), abs(rows[0, Stat.SHIFT].item())
    s1 = rows[:, Stat.SHIFT_SUM]
    s2 = rows[:, Stat.SHIFT_SUMSQ]
    rel = max(rel, ((s1 - s1[0]).abs().max() / (math.sqrt(n * rows[0, Stat.SUMSQ].item())
                                                  + n * k)).item(),
              ((s2 - s2[0]).abs().max() / s2[0]).item())
    print(f"max relative spread of sums over 5 runs: {rel:.3g}")
    assert rel < 1e-12


@pytest.mark.parametrize("fast", [2, 0, "bytes"], ids=["fast", "careful", "bytes"])
@pytest.mark.parametrize("kind", ["normal", "nonfinite_one_block", "zero_blocks", "wide_block",
                                  "all_above_thresholds", "all_nonfinite", "mixed", "narrow"])
@pytest.mark.parametrize("dname", list(DTYPES))
def test_gpu_tile_branches_match_reference(dname, kind, fast):
    # tiles that take each uniform branch of the careful pass: NaN/Inf in a few tiles, all-zero
    # tiles, 32/64/128-bin histogram windows, thresholds straddled or not, scaled or not; and
    # the fast pass (lane histogram in shared memory) with its per-program fallback
    from test_kernel_tile import blocks
    from stabilitywatch.kernels.stats_triton import launch_row_stats

    from stabilitywatch.kernels.constants import FastPass
    from stabilitywatch.kernels.tuning import Tuning

    def triton_row(t, scale=1.0):
        row = init_row_tensor(t.device)
        tuning = (Tuning(fast=FastPass.LANE_HISTOGRAM, fp8_bytes=True) if fast == "bytes"
                  else Tuning(fast=FastPass(fast)))
        launch_row_stats(t.reshape(-1), row, scale, tuning=tuning)
        return row

    if kind == "narrow":  # every tile within a few exponents: the 32-bin window
        x = (1.0 + torch.rand(8192 * 9 + 77, generator=torch.Generator().manual_seed(5)))
        x = x.to(DTYPES[dname])
    else:
        x = blocks(kind, DTYPES[dname])
    x = x.cuda()
    assert_rows_match(triton_row(x), reference_row(x), label=f"cuda {dname} {kind}")
    s = torch.tensor(2.0 ** -12, device="cuda")
    assert_rows_match(triton_row(x, s), reference_row(x, s), label=f"cuda {dname} {kind} scaled")


@pytest.mark.parametrize("dname", ["fp32", "bf16", "e4m3"])
def test_gpu_fast_pass_runs_and_falls_back(dname):
    # careful_parts=0 (the timing kernel) empties the careful pass's histogram, not the fast
    # pass's:
    # ordinary data stays on the fast pass; one tile (one program) with each kind of data the
    # fast pass cannot count exactly goes to the careful pass, and both give the reference row
    from test_kernel_fast import TRIGGERS, hist, ordinary
    from stabilitywatch.kernels._timing import Timing, launch_timed
    from stabilitywatch.kernels.constants import FastPass
    from stabilitywatch.kernels.stats_triton import launch_row_stats
    from stabilitywatch.kernels.tuning import Tuning, tile_shape

    dtype = DTYPES[dname]

    def row_of(t, careful_parts=None, **tuning):
        row = init_row_tensor(t.device)
        tu = Tuning(fast=FastPass.LANE_HISTOGRAM, **tuning)
        if careful_parts is None:
            launch_row_stats(t.reshape(-1), row, tuning=tu)
        else:
            launch_timed(t.reshape(-1), row, Timing(careful_parts=careful_parts), tu)
        return row

    u, t, v = tile_shape(torch.empty(0, dtype=dtype).element_size(), False)
    tile = u * t * v
    x = ordinary(tile * 1000 + 5, dtype).cuda()
    assert hist(row_of(x, careful_parts=0)).sum() > 0
    assert_rows_match(row_of(x), reference_row(x), label=f"{dname} ordinary")
    odd = x[1:]  # bf16 at a 2-byte offset: not read as 32-bit words
    assert_rows_match(row_of(odd), reference_row(odd), label=f"{dname} offset by one")
    for name, vals in TRIGGERS.items():
        y = ordinary(tile, torch.float32, seed=1)
        y[5: 5 + len(vals)] = torch.tensor(vals)
        y = y.to(dtype).cuda()
        if dname == "e4m3" and name != "nan":
            continue  # no Inf in e4m3, and the other triggers are outside its range
        assert hist(row_of(y, careful_parts=0)).sum() == 0, name
        assert_rows_match(row_of(y), reference_row(y), label=f"{dname} {name}")
        if dname == "e4m3":  # the byte-count pass has no fallback: it takes every value
            assert hist(row_of(y, careful_parts=0, fp8_bytes=True)).sum() > 0
            assert_rows_match(row_of(y, fp8_bytes=True), reference_row(y), label="e4m3 bytes nan")


@pytest.mark.parametrize("dname", ["bf16", "fp16", "fp32"])
def test_gpu_threshold_table_on_every_value_near_the_thresholds(dname):
    # the fast pass's threshold counts come from its shared-memory table (ptx.py): every 16-bit
    # value of exponent field 100..141 (and, for fp32, each threshold and one ulp either side),
    # both signs, spread over many programs, against the reference's compares
    from stabilitywatch.kernels.constants import FastPass
    from stabilitywatch.kernels.stats_triton import launch_row_stats
    from stabilitywatch.kernels.tuning import Tuning
    src = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.bfloat16}[dname]
    vals = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16).view(src).float()
    keep = (vals.abs() >= 2.0 ** -27) & (vals.abs() < 2.0 ** 15) & vals.isfinite()
    v = vals[keep]
    if dname == "fp32":
        edges = []
        for f in FORMATS.values():
            for t in (f.underflow_threshold, f.subnormal_limit, f.max):
                t = torch.tensor(t)
                edges += [t, torch.nextafter(t, torch.tensor(0.0)),
                          torch.nextafter(t, torch.tensor(1e9))]
        v = torch.cat([v, torch.stack(edges)])
        v = v[v.abs() < 2.0 ** 15]
    x = torch.cat([v, -v]).repeat(64)
    x = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(0))]
    x = x.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dname]).cuda()
    row = init_row_tensor(x.device)
    launch_row_stats(x, row, tuning=Tuning(fast=FastPass.LANE_HISTOGRAM))
    assert_rows_match(row, reference_row(x), label=dname)


@pytest.mark.parametrize("dname", list(DTYPES))
def test_gpu_many_tensors_in_one_launch(dname):
    from stabilitywatch.kernels.dispatch import MULTI_MAX
    from stabilitywatch.kernels.stats_multi import launch_many

    ts = [gpu_values(n, DTYPES[dname], seed=n) for n in (1, 127, 4097, 70001, MULTI_MAX)]
    rows = torch.stack([init_row_tensor("cuda") for _ in range(8)])
    slots = [7, 2, 0, 5, 3]
    launch_many([t.reshape(-1) for t in ts], rows, slots)
    for t, s in zip(ts, slots):
        assert_rows_match(rows[s], reference_row(t), sum_rtol=1e-12, label=f"{dname} {t.numel()}")


@pytest.mark.parametrize("dname", ["fp32", "bf16", "fp16"])
def test_gpu_large_tensors_in_one_tile_launch(dname):
    # kernels/tile_multi.py through dispatch.accumulate_many: full tiles of every large tensor
    # in one launch (clean data takes the fast pass, NaN/Inf the careful pass), tails with the
    # small tensors; each row as the reference's
    from stabilitywatch.kernels import dispatch
    from stabilitywatch.kernels.tile_multi import TileManyLaunch

    dt = DTYPES[dname]
    g = torch.Generator(device="cuda").manual_seed(5)
    clean = (torch.randn(3 * 2**20 + 77, device="cuda", generator=g) * 0.02).to(dt)
    wide = gpu_values(2**22, dt, seed=9)  # NaN/Inf and every threshold
    big = torch.randn(2**25, device="cuda", generator=g).to(dt)
    tr = torch.randn(768, 3072, device="cuda", generator=g).to(dt).t()
    small = gpu_values(4097, dt, seed=2)
    ts, slots = [clean, wide, small, big, tr], [3, 0, 6, 1, 7]
    rows = torch.stack([init_row_tensor("cuda") for _ in range(8)])
    launches = [lk for lk, _ in dispatch.accumulate_many(ts, rows, slots)]
    assert sum(isinstance(x, TileManyLaunch) for x in launches) == 1
    for t, s in zip(ts, slots):
        assert_rows_match(rows[s], reference_row(t), sum_rtol=1e-12, label=f"{dname} {t.shape}")


def _same_row(a: torch.Tensor, b: torch.Tensor, n: int) -> bool:
    # every field bit for bit but the float64 sums, whose atomic merge order varies: the sum of
    # squares to 1e-12, the sum to 1e-12 of sum(|x|) <= sqrt(n * sum of squares) (gpu_values
    # holds +-3.4e38 next to values near 1: the sum's last bits are those of 3.4e38)
    s, q = int(Stat.SUM), int(Stat.SUMSQ)
    s1, s2 = int(Stat.SHIFT_SUM), int(Stat.SHIFT_SUMSQ)
    keep = torch.ones_like(a, dtype=torch.bool)
    keep[[s, q, s1, s2]] = False
    bound = 1e-12 * math.sqrt(n * float(a[q]))
    bound1 = bound + 1e-12 * n * abs(float(a[Stat.SHIFT]))
    return bool(torch.equal(a[keep], b[keep]) and math.isclose(a[q], b[q], rel_tol=1e-12)
                and abs(float(a[s]) - float(b[s])) <= bound
                and abs(float(a[s1]) - float(b[s1])) <= bound1
                and math.isclose(a[s2], b[s2], rel_tol=1e-12))


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("scale", [1.0, 0.5, "tensor"])
def test_kept_launch_plans_give_the_decided_rows(dname, scale):
    # launch_row_stats keeps its decisions per kind of tensor (stats_triton._RowPlan); an
    # explicit tuning (here the default) takes the path that decides on every call
    from stabilitywatch.kernels import stats_triton
    from stabilitywatch.kernels.dispatch import flat_view
    from stabilitywatch.kernels.tuning import Tuning
    sc = torch.tensor(0.25, device="cuda") if scale == "tensor" else scale
    for n in (1, 2048, 4096 + 7, 2**20 + 3, 2**21):
        x = flat_view(gpu_values(n, DTYPES[dname], seed=n))
        for offset in (0, 1):  # an unaligned start (bf16 words, fp8 bytes)
            v = x[offset:]
            kept = [init_row_tensor("cuda") for _ in range(2)]
            for row in kept:  # the second call runs the kept plan
                stats_triton.launch_row_stats(v, row, sc)
            decided = init_row_tensor("cuda")
            stats_triton.launch_row_stats(v, decided, sc, tuning=Tuning())
            for row in kept:
                assert _same_row(row.cpu(), decided.cpu(), n), (dname, scale, n, offset)


@pytest.mark.parametrize("dname", ["fp32", "bf16"])
def test_gpu_add_many_plan_takes_new_addresses(dname):
    # the taps' gradients come back at new addresses each step (set to None in between): the
    # kept multi-tensor launches take them (stats/plans.rebind, one table copy each) and give
    # the rows that one add() per tensor gives
    from stabilitywatch.kernels.backend import kernel_backend
    from stabilitywatch.stats.buffer import StatsBuffer
    dt = DTYPES[dname]
    sizes = (1, 4097, 3 * 2**20 + 77, 768 * 3072)

    def make(step):
        return [(gpu_values(n, dt, seed=100 * step + k), f"m{k}", "grad", 1.0)
                for k, n in enumerate(sizes)]

    one, many = StatsBuffer(kernel_backend()), StatsBuffer(kernel_backend())
    keep, seen = None, []
    for step in range(3):
        items = make(step)  # the earlier steps' tensors stay alive: new addresses each step
        seen.append(items)
        for b in (one, many):
            b.begin_step(step)
        for t, m, r, s in items:
            one.add(t, m, r, 5, scale=s, overwrite=True)
        many.add_many(items, 5, overwrite=True)
        plan = many._plans[(5, True)]
        keep = keep or plan
        assert plan is keep and plan.addrs == tuple(t.data_ptr() for t, _, _, _ in items)
        assert step == 0 or plan.addrs != tuple(t.data_ptr() for t, _, _, _ in seen[-2])
        for b in (one, many):
            b.end_step()
        f1, f2 = one.poll(block=True)[0], many.poll(block=True)[0]
        for i, key in enumerate(f1.keys):
            assert _same_row(torch.from_numpy(f2.rows[i]), torch.from_numpy(f1.rows[i]),
                             sizes[i]), (dname, step, key)


@pytest.mark.parametrize("n", [4097, 2**20 + 3, 2**26], ids=["4097", "1M+3", "2^26"])
@pytest.mark.parametrize("dname", ["fp32", "bf16", "fp16", "e4m3"])
def test_gpu_std_keeps_its_precision(dname, n):
    # a mean large against the spread: every pass (fast, careful at a scale, fp8 bytes) gives
    # the std of float64 numpy's two-pass formula, from the shifted sums
    import numpy as np
    from stabilitywatch.kernels.stats_triton import triton_row
    from stabilitywatch.stats.derive import derive

    base = {"fp32": 2.0**23, "bf16": 256.0, "fp16": 1024.0, "e4m3": 256.0}[dname]
    g = torch.Generator(device="cuda").manual_seed(n % 1000)
    x = (base + 2 * torch.randint(-3, 4, (n,), device="cuda", generator=g)).to(DTYPES[dname])
    xs = x.double().cpu().numpy()
    want = math.sqrt(np.mean((xs - xs.mean()) ** 2))
    for scale in (1.0, 0.5, torch.tensor(0.5, device="cuda")):
        row = triton_row(x, scale)
        assert_rows_match(row, reference_row(x, scale), label=f"cuda {dname} {n} {scale}")
        assert derive(row.cpu().numpy(), float(scale))["std"] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("sval", [math.nan, math.inf, -math.inf, 0.0, -2.0, 1e-40, 1e-50, 1e39])
@pytest.mark.parametrize("dname", list(DTYPES))
def test_gpu_bad_scales_match_reference(dname, sval):
    # a tensor-valued scale that turns out bad on the device, and the same value as a float
    from stabilitywatch.kernels.stats_triton import triton_row

    x = gpu_values(2**20 + 3, DTYPES[dname], seed=7)
    for s in (torch.tensor(sval, device="cuda"), torch.tensor(sval, dtype=torch.float64,
                                                               device="cuda"), sval):
        assert_rows_match(triton_row(x, s), reference_row(x, s),
                          label=f"cuda {dname} scale {sval!r} {type(s).__name__}")


@pytest.mark.parametrize("dname", list(DTYPES))
def test_gpu_accumulate_direct_path_gives_the_flat_view_rows(dname):
    """dispatch.accumulate's path for CUDA tensors (no flat_view call for a contiguous plain
    tensor) writes the rows launch_row_stats(flat_view(t)) writes, for every kind of view."""
    from stabilitywatch.kernels import dispatch
    from stabilitywatch.kernels.stats_triton import launch_row_stats

    base = gpu_values(96 * 130 + 7, DTYPES[dname], 5)[:96 * 130].reshape(96, 130)
    views = {"contiguous": base, "transposed": base.T, "strided": base[:, ::3],
             "one": base[:1, :1], "empty": base[:0]}
    if DTYPES[dname] in (torch.float32, torch.bfloat16, torch.float16):
        views["requires_grad"] = base.clone().requires_grad_()
    if dname == "fp32":   # a view whose negative bit is set: its memory holds -values
        views["negative"] = torch.randn(64, 33, dtype=torch.complex64, device="cuda").conj().imag
        assert views["negative"].is_neg()
    sums = (Stat.SUM, Stat.SUMSQ, Stat.SHIFT_SUM, Stat.SHIFT_SUMSQ)
    for name, t in views.items():
        got, want = init_row_tensor("cuda"), init_row_tensor("cuda")
        dispatch.accumulate(t, got, 0.5)
        if t.numel():
            launch_row_stats(dispatch.flat_view(t), want, 0.5)
        exact = [i for i in range(got.numel()) if i not in sums]
        assert torch.equal(got[exact], want[exact]), name
        # the programs of a launch add their sums into the row in the order they finish, so two
        # launches agree to float64 rounding of the partial sums, not bit for bit: sums of
        # squares relatively, signed sums (which may cancel) against their terms' magnitude
        n = max(float(got[Stat.NUMEL]), 1.0)
        for k, sq in ((Stat.SUM, Stat.SUMSQ), (Stat.SHIFT_SUM, Stat.SHIFT_SUMSQ)):
            assert torch.allclose(got[sq], want[sq], rtol=1e-12, atol=0), (name, sq)
            tol = 1e-12 * (n * float(want[sq].abs())) ** 0.5
            assert abs(float(got[k] - want[k])) <= tol, (name, k, float(got[k]), float(want[k]))
        assert_rows_match(got, reference_row(t.detach(), 0.5), label=f"{dname} {name}")
