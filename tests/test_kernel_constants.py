"""The kernels' named constants (kernels/constants.py), their typed tuning (kernels/tuning.py)
and the timing variant of the tile kernel (kernels/_timing.py)."""
import ast
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from rowcheck import assert_rows_match  # noqa: E402

from stabilitywatch.formats import FORMATS, Fmt  # noqa: E402
from stabilitywatch.kernels import constants as C  # noqa: E402
from stabilitywatch.kernels import tuning  # noqa: E402
from stabilitywatch.stats.layout import FMT_BASE, Stat, init_row_tensor  # noqa: E402

KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "stabilitywatch", "kernels")


def test_namespaces_mirror_the_enums():
    assert {m.name: int(m) for m in Stat} == {
        k: v.value for k, v in vars(C.Row).items() if not k.startswith("__")}
    assert {m.name: int(m) for m in C.Encoding} == {
        k: v.value for k, v in vars(C.Enc).items() if not k.startswith("__")}
    assert set(C.ENCODING) == {torch.float32, torch.float16, torch.bfloat16,
                               torch.float8_e4m3fn, torch.float8_e5m2}
    assert [e for e in C.Encoding if e.is_fp8] == [C.Encoding.E4M3, C.Encoding.E5M2]
    for fmt, name in ((Fmt.E4M3, "E4M3"), (Fmt.E5M2, "E5M2"), (Fmt.FP16, "FP16")):
        f = FORMATS[fmt]
        assert getattr(C, f"{name}_MAX").value == f.max
        assert getattr(C, f"{name}_MAX_BITS").value == C.float_bits(f.max)
        assert getattr(C, f"{name}_UNDERFLOW_BITS").value == C.float_bits(f.underflow_threshold)
        assert getattr(C, f"{name}_NORMAL_BITS").value == C.float_bits(f.subnormal_limit) - 1
        assert FMT_BASE[fmt] == getattr(Stat, f"{name}_OVERFLOW")


def _sources():
    for name in sorted(os.listdir(KERNELS)):
        if name.endswith(".py"):
            with open(os.path.join(KERNELS, name)) as f:
                yield name, f.read()


def test_epilogues_write_named_fields_and_constants_live_in_one_module():
    assigned: dict = {}
    for name, src in _sources():
        for node in ast.walk(ast.parse(src)):
            # _put(v, idx, FIELD, x): the field is a Row offset, never an int literal
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_put":
                assert not isinstance(node.args[2], ast.Constant), (name, node.lineno)
            if isinstance(node, ast.Assign) and node.col_offset == 0:
                for t in node.targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            assigned.setdefault(n.id, []).append(name)
    for const in ("HBINS", "INF_BITS", "ABS_MASK", "E4M3_MAX_BITS", "FP16_NORMAL_BITS"):
        assert assigned.get(const) == ["constants.py"], (const, assigned.get(const))


def test_the_production_tile_kernel_has_no_timing_switches():
    from stabilitywatch.kernels import _timing, stats_tile
    names = stats_tile._tile_stats_kernel.arg_names
    assert not {"SUM32", "PARTS", "FPARTS", "CAREFUL_PARTS", "FAST_PARTS", "ROW_WRITES"} & set(
        names)
    plan = tuning.tile_plan(tuning.Tuning(), C.Encoding.BF16, (2, 128, 8), 1 << 26, 528, False,
                            False, True, True, True)
    # the constexprs in declaration order (launch.FastLaunch replays them by position)
    assert list(plan.constexprs) == names[5:]
    timed = _timing._tile_timing_kernel.arg_names
    assert timed[:len(names)] == names
    assert list({**plan.constexprs, **_timing.Timing().constexprs()}) == timed[5:]
    assert plan.options == {"maxnreg": 96}
    assert plan.constexprs["ENC"] == C.Encoding.BF16 and type(plan.constexprs["ENC"]) is int


@pytest.mark.parametrize("field, value", [
    ("num_warps", 3), ("num_warps", 0), ("progs_per_sm", 0), ("loads_per_thread", 0),
    ("fast", 7), ("ballot", "yes"), ("register_cap", -1), ("prefetch", 1.5),
    ("general_only", 1)])
def test_bad_tuning_names_its_field(field, value):
    with pytest.raises(ValueError, match=f"Tuning.{field}"):
        tuning.Tuning(**{field: value})


def test_tuning_is_typed():
    from stabilitywatch.kernels.stats_triton import launch_row_stats
    assert tuning.Tuning(fast=1).fast is C.FastPass.TL_HISTOGRAM
    row = init_row_tensor("cpu")
    with pytest.raises(TypeError, match="Tuning"):
        launch_row_stats(torch.ones(4), row, 1.0, {"fast": 1})
    from stabilitywatch.kernels._timing import Timing
    with pytest.raises(ValueError, match="Timing.fast_parts"):
        Timing(fast_parts=4)


@pytest.mark.interpreter
@pytest.mark.parametrize("dname", ["bf16", "e4m3"])
def test_timing_kernel_with_every_part_gives_the_production_row(dname):
    from stabilitywatch.kernels._timing import Timing, launch_timed
    from stabilitywatch.kernels.stats_triton import launch_row_stats
    dtype = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}[dname]
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(8192 * 2 + 5, generator=g) * 4).to(dtype)
    x[100] = float("nan")  # the fast pass hands the program to the careful pass
    t = tuning.Tuning(fast=C.FastPass.TL_HISTOGRAM, fp8_bytes=dname == "e4m3")
    want, got, off = (init_row_tensor("cpu") for _ in range(3))
    launch_row_stats(x, want, 1.0, t)
    launch_timed(x, got, Timing(), t)
    assert_rows_match(got, want, label=dname)
    launch_timed(x, off, Timing(row_writes=False), t)  # only the general kernel's tail
    tail = init_row_tensor("cpu")
    launch_row_stats(x[-5:], tail, 1.0)
    assert off[Stat.NUMEL] == 5 and torch.equal(off[Stat.HIST:], tail[Stat.HIST:])
