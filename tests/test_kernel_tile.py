"""The tile kernel (full tiles of large tensors) against the reference, on tile structures
that take each of its branches: NaN/Inf only in some tiles, all-zero tiles, tiles spanning
more than 32 or 64 exponents, thresholds straddled or not, scales as floats and tensors. Under
the interpreter a tile is 8192 elements (tuning.tile_shape); the warp-ballot histogram is
GPU-only (test_kernel_gpu.py)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from rowcheck import assert_rows_match  # noqa: E402
from test_kernel import DTYPES, content  # noqa: E402

from stabilitywatch.kernels import dispatch  # noqa: E402
from stabilitywatch.kernels.constants import FastPass  # noqa: E402
from stabilitywatch.kernels.stats_triton import launch_row_stats, triton_row  # noqa: E402
from stabilitywatch.kernels.tuning import Tuning  # noqa: E402
from stabilitywatch.stats.layout import init_row_tensor  # noqa: E402
from stabilitywatch.stats.reference import reference_row  # noqa: E402

pytestmark = pytest.mark.interpreter

BLOCK = 8192  # the interpreter's tile and block size (tuning.tile_shape, general_shape)


def blocks(kind: str, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    n = BLOCK * 9 + 77
    x = torch.randn(n, generator=g)
    if kind == "nonfinite_one_block":
        x[BLOCK * 2 + 5] = float("nan")
        x[BLOCK * 2 + 9] = float("inf")
        x[BLOCK * 7 + 1] = float("-inf")
    elif kind == "zero_blocks":
        x[: BLOCK * 2] = 0
        x[BLOCK * 5: BLOCK * 6] = -0.0
    elif kind == "wide_block":
        x[BLOCK * 3: BLOCK * 4] = content("lognormal", BLOCK, torch.float32, 5)
    elif kind == "all_above_thresholds":
        x = 1.0 + x.abs()
    elif kind == "all_nonfinite":
        x[:] = float("nan")
        x[::3] = float("inf")
    elif kind == "mixed":
        x = content("mixed", n, torch.float32, 11)
    return x.to(dtype)


KINDS = ["normal", "nonfinite_one_block", "zero_blocks", "wide_block", "all_above_thresholds",
         "all_nonfinite", "mixed"]


@pytest.mark.parametrize("fast", [1, 0], ids=["fast", "careful"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dname", list(DTYPES))
def test_tile_kernel_matches_reference(dname, kind, fast):
    # fast 1: the fast pass, falling back per program (tile_fast.py); 0: the careful pass only
    x = dispatch.flat_view(blocks(kind, DTYPES[dname]))
    row = init_row_tensor(x.device)
    launch_row_stats(x, row, tuning=Tuning(fast=FastPass(fast)))
    assert_rows_match(row, reference_row(x), label=f"{dname} {kind} fast={fast}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dname", ["e4m3", "e5m2"])
def test_fp8_byte_count_pass_matches_reference(dname, kind):
    # tile_fp8.py (large fp8 tensors take it by default, scaled fp8 at any size)
    x = dispatch.flat_view(blocks(kind, DTYPES[dname]))
    row = init_row_tensor(x.device)
    launch_row_stats(x, row, tuning=Tuning(fast=FastPass.TL_HISTOGRAM, fp8_bytes=True))
    assert_rows_match(row, reference_row(x), label=f"{dname} {kind} bytes")


@pytest.mark.parametrize("scale", [0.25, 3.7, 1e30, torch.tensor(2.0 ** -12)],
                         ids=["0.25", "3.7", "1e30", "tensor2^-12"])
@pytest.mark.parametrize("dname", ["fp32", "bf16", "e4m3"])
def test_tile_kernel_scaled(dname, scale):
    x = blocks("mixed", DTYPES[dname])
    assert_rows_match(triton_row(x, scale), reference_row(x, scale), label=f"{dname} {scale}")


def test_exact_multiple_of_block_has_no_tail():
    x = blocks("normal", torch.bfloat16)[: BLOCK * 8]
    assert_rows_match(triton_row(x), reference_row(x))


def test_tile_offsets_in_int64_near_2_pow_31():
    # Triton passes an n_full below 2^31 as int32; offsets a few grid steps past a tile would
    # wrap there, so such tensors take the kernel's int64 offsets (WIDE)
    from stabilitywatch.kernels.tuning import wide_offsets
    step = 528 * 2048  # the H200's grid step for bf16: 4 programs per SM, 2048-element tiles
    assert not wide_offsets(2**28, step) and not wide_offsets(2**31 - 13 * step, step)
    assert wide_offsets(2**31 - 12 * step, step) and wide_offsets(2**31 - 2048, step)
    # the int64 path gives the same rows
    for dname in ("fp32", "bf16", "e4m3"):
        x = dispatch.flat_view(blocks("mixed", DTYPES[dname]))
        row = init_row_tensor(x.device)
        launch_row_stats(x, row, tuning=Tuning(fast=FastPass.TL_HISTOGRAM, wide=True))
        assert_rows_match(row, reference_row(x), label=f"{dname} wide")
