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
from stabilitywatch.kernels.backend import kernel_backend  # noqa: E402
from stabilitywatch.stats.buffer import StatsBuffer  # noqa: E402
from stabilitywatch.stats.layout import init_row_tensor  # noqa: E402
from stabilitywatch.stats.reference import reference_row  # noqa: E402

pytestmark = pytest.mark.interpreter

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
    one, many = StatsBuffer(kernel_backend("triton")), StatsBuffer(kernel_backend("triton"))
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


def _one_step_both_ways(one, many, items, step, phase, check):
    # one step: add() per item into `one`, add_many() into `many`, check(), then equal rows
    for b in (one, many):
        b.begin_step(step)
    for t, m, r, s in items:
        one.add(t, m, r, phase, scale=s)
    many.add_many(items, phase)
    check()
    for b in (one, many):
        b.end_step()
    f1, f2 = one.poll(block=True)[0], many.poll(block=True)[0]
    assert f1.keys == f2.keys
    for i, key in enumerate(f1.keys):
        assert_rows_match(f2.rows[i], f1.rows[i], label=f"step {step} {key}")


_PLAN = {}


def _kept(many, step):
    if step == 0:
        _PLAN["first"] = many._plans[(1, False)]
    elif step == 1:
        assert many._plans[(1, False)] is _PLAN["first"]   # kept
    else:
        assert (1, False) not in many._plans or many._plans[(1, False)] is _PLAN["first"]


def test_add_many_repeats_its_launches_on_the_same_tensors():
    # the second step takes the kept plan (no host work per tensor): its rows must follow the
    # tensors' new values, like one add() per tensor; a strided tensor (copied to be read) and
    # a new tensor in the list make a new plan
    ts = tensors(torch.float32) + tensors(torch.bfloat16, seed=1)
    big = torch.randn(MULTI_MAX + 3)
    items = [(t, f"m{i}", "weight", 1.0) for i, t in enumerate(ts)] + [(big, "big", "weight", 1.0)]
    one, many = StatsBuffer(kernel_backend("triton")), StatsBuffer(kernel_backend("triton"))
    for step in range(3):
        if step == 2:
            items = items + [(torch.randn(64, 80)[:, ::3], "s", "weight", 1.0)]
        _one_step_both_ways(one, many, items, step, 1, check=lambda: _kept(many, step))
        for t in ts + [big]:  # new values for the next step, same storage
            t.mul_(-2)


def test_add_many_plan_takes_the_new_addresses_of_like_tensors():
    # gradients set to None between steps come back as new tensors of the same shapes: the
    # kept plan's launches take their addresses (step 1); a large tensor at an address the
    # tile launch cannot read (not 16-byte aligned) makes a new plan (step 2); rows as add()'s
    def make(seed, misaligned=False):
        big = torch.randn(MULTI_MAX + 1 + 3 * misaligned, generator=torch.Generator().manual_seed(seed))
        big = big[3:] if misaligned else big
        ts = tensors(torch.float32, seed) + tensors(torch.bfloat16, seed + 1)
        return [(t, f"m{i}", "grad", 1.0) for i, t in enumerate(ts)] + [(big, "big", "grad", 1.0)]

    one, many = StatsBuffer(kernel_backend("triton")), StatsBuffer(kernel_backend("triton"))
    first = None
    for step, items in enumerate((make(0), make(1), make(2, misaligned=True))):
        def check():
            nonlocal first
            plan = many._plans[(5, False)]
            if step == 0:
                first = plan
            else:
                assert (plan is first) == (step == 1)
                assert plan.addrs == tuple(t.data_ptr() for t, _, _, _ in items)

        _one_step_both_ways(one, many, items, step, 5, check)


def test_add_many_plan_is_not_taken_for_other_tensors():
    a = [torch.randn(100) for _ in range(3)]
    b = [torch.randn(100) for _ in range(3)]
    buf = StatsBuffer(kernel_backend("triton"))
    for step, ts in enumerate((a, b, a)):
        buf.begin_step(step)
        buf.add_many([(t, f"m{i}", "weight", 1.0) for i, t in enumerate(ts)], 1)
        buf.end_step()
        f = buf.poll(block=True)[0]
        for i, t in enumerate(ts):
            assert_rows_match(f.rows[i], reference_row(t).numpy(), label=f"step {step} m{i}")


def test_add_many_keeps_no_plan_for_tensor_scales():
    # a tensor-valued scale lives on the device: the plan's signature must not read it (a sync
    # on CUDA), and such a list is never repeated from a plan
    from stabilitywatch.stats.plans import many_sig as _many_sig

    class NoRead(torch.Tensor):
        def __float__(self):
            raise AssertionError("read a tensor scale on the host")

    scale = torch.tensor(0.5).as_subclass(NoRead)
    t = torch.randn(100)
    assert _many_sig([(t, "m", "weight", scale)]) is None
    assert _many_sig([(t, "m", "weight", 1.0)]) is not None


def test_add_many_plan_tells_strides_apart():
    # same address, same count, other strides: base[:100] then base[::2] must not share a plan
    base = torch.arange(200, dtype=torch.float32)
    buf = StatsBuffer(kernel_backend("triton"))
    for step, t in enumerate((base[:100], base[::2])):
        buf.begin_step(step)
        buf.add_many([(t, "m", "weight", 1.0)], 1)
        buf.end_step()
        f = buf.poll(block=True)[0]
        assert_rows_match(f.rows[0], reference_row(t).numpy(), label=f"step {step}")


@pytest.mark.parametrize("dname", ["fp32", "bf16", "fp16"])
def test_large_tensors_share_one_tile_launch(dname):
    # tensors above MULTI_MAX: their full tiles in one tile_multi launch, their tails with the
    # small tensors; one has NaN/Inf (its programs take the careful pass), one is a transpose
    from stabilitywatch.kernels.tile_multi import TileManyLaunch
    dt = DTYPES[dname]
    g = torch.Generator().manual_seed(3)
    plain = (torch.randn(MULTI_MAX + 3, generator=g) * 3).to(dt)
    bad = torch.randn(2 * MULTI_MAX, generator=g).to(dt)
    bad[100], bad[MULTI_MAX + 5], bad[7] = float("nan"), float("inf"), 0.0
    wide = torch.randn(520, 512, generator=g).to(dt).t()  # dense, not contiguous
    small = tensors(dt)[2]
    ts, slots = [plain, small, bad, wide], [4, 1, 0, 6]
    assert all(dispatch.tileable(t, 1.0, "triton") for t in (plain, bad, wide))
    assert not dispatch.tileable(small, 1.0, "triton") and not dispatch.tileable(plain, 2.0, "triton")
    assert not dispatch.tileable(plain[1:], 1.0, "triton")  # not 16-byte aligned
    assert not dispatch.tileable(torch.zeros(MULTI_MAX + 1).to(torch.float8_e4m3fn), 1.0, "triton")
    rows = torch.stack([init_row_tensor("cpu") for _ in range(8)])
    launches = [lk for lk, _ in dispatch.accumulate_many(ts, rows, slots)]
    assert sum(isinstance(x, TileManyLaunch) for x in launches) == 1
    for t, s in zip(ts, slots):
        assert_rows_match(rows[s], reference_row(t), label=f"{dname} {tuple(t.shape)}")
    again = torch.stack([init_row_tensor("cpu") for _ in range(8)])
    for lk in launches:  # a kept launch, run again on fresh rows, gives the same rows
        lk.run(again)
    for s in slots:
        assert_rows_match(again[s], rows[s], label=f"{dname} again {s}")


def test_add_many_overwrite_keeps_the_last_write_of_a_row():
    # overwrite=True and one (module, role) twice: as add() one after the other, the second
    # tensor's statistics replace the first's, small or large
    a, b = torch.randn(MULTI_MAX + 1), torch.randn(MULTI_MAX + 5) * 4
    c, d = torch.randn(100), torch.randn(300)
    items = [(a, "m", "grad", 1.0), (c, "s", "grad", 1.0), (b, "m", "grad", 1.0),
             (d, "s", "grad", 1.0)]
    one, many = StatsBuffer(kernel_backend("triton")), StatsBuffer(kernel_backend("triton"))
    for buf in (one, many):
        buf.begin_step(0)
    for t, m, r, s in items:
        one.add(t, m, r, 2, scale=s, overwrite=True)
    many.add_many(items, 2, overwrite=True)
    for buf in (one, many):
        buf.end_step()
    f1, f2 = one.poll(block=True)[0], many.poll(block=True)[0]
    assert f1.keys == f2.keys == [("m", "grad"), ("s", "grad")]
    for i, key in enumerate(f1.keys):
        assert_rows_match(f2.rows[i], f1.rows[i], label=str(key))
    assert f2.rows[0][0] == MULTI_MAX + 5 and f2.rows[1][0] == 300  # numel of the last write


def test_prefetch_only_where_the_ptx_has_it(monkeypatch):
    # cp.async.bulk.prefetch needs sm_90: on an A100 or an L4 the kernels get PREF=0
    from stabilitywatch.kernels import tuning
    for cap, want in (((8, 0), 0), ((8, 9), 0), ((9, 0), 2), ((10, 0), 2)):
        tuning.prefetch_tiles.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, c=cap: c)
        assert tuning.prefetch_tiles(0, 2) == want, cap
    tuning.prefetch_tiles.cache_clear()


def test_no_address_tables_for_cuda_tensors_under_the_interpreter(monkeypatch):
    # the multi-tensor launches pass device addresses in a table; the interpreter copies CUDA
    # arguments to the host, so such tensors take one launch each there
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    t = torch.randn(10)
    assert dispatch._addresses_ok(t)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert not dispatch._addresses_ok(t)
