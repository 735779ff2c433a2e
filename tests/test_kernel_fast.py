"""The tile kernel's fast pass (kernels/tile_fast.py): taken on ordinary data, and left for the
careful pass, program by program, on each kind of data its derivations cannot handle exactly.

Which pass ran is seen through the timing kernel's careful_parts=0 (kernels/_timing.py): the
careful pass then skips the format counts and the histogram, the fast pass ignores it. Under the
interpreter a tile is 8192 elements and a tensor of 8192 elements is one program."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from rowcheck import assert_rows_match  # noqa: E402

from stabilitywatch.formats import FORMATS, Fmt  # noqa: E402
from stabilitywatch.kernels._timing import Timing, launch_timed  # noqa: E402
from stabilitywatch.kernels.constants import FastPass  # noqa: E402
from stabilitywatch.kernels.stats_triton import launch_row_stats  # noqa: E402
from stabilitywatch.kernels.tuning import Tuning  # noqa: E402
from stabilitywatch.stats.layout import HIST_BINS, Stat, init_row_tensor  # noqa: E402
from stabilitywatch.stats.reference import reference_row  # noqa: E402

pytestmark = pytest.mark.interpreter

TILE = 8192
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}


def row_of(x: torch.Tensor, careful_parts: "int | None" = None, **tuning) -> torch.Tensor:
    # careful_parts=0: the careful pass leaves its counts and histogram out (the row then holds
    # only what the fast pass counted, where it ran)
    row = init_row_tensor(x.device)
    t = Tuning(fast=FastPass.TL_HISTOGRAM, **tuning)
    if careful_parts is None:
        launch_row_stats(x.reshape(-1), row, tuning=t)
    else:
        launch_timed(x.reshape(-1), row, Timing(careful_parts=careful_parts), t)
    return row


def hist(row: torch.Tensor) -> torch.Tensor:
    return row[int(Stat.HIST): int(Stat.HIST) + HIST_BINS]


def ordinary(n: int, dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    x[::7] = 0.0
    return x.clamp(-400, 400).to(dtype)


@pytest.mark.parametrize("dname", list(DTYPES))
def test_fast_pass_runs_on_ordinary_data(dname):
    x = ordinary(TILE * 3, DTYPES[dname])
    row = row_of(x, careful_parts=0)
    assert hist(row).sum() > 0, "the careful pass ran (PARTS=0 left the histogram empty)"
    assert_rows_match(row, reference_row(x), label=dname)


_E4, _E5, _F16 = FORMATS[Fmt.E4M3], FORMATS[Fmt.E5M2], FORMATS[Fmt.FP16]
TRIGGERS = {
    "nan": [float("nan")],
    "inf": [float("inf"), float("-inf")],
    "f32_subnormal": [1e-40],
    "e5m2_fp16_max_bin": [60000.0, -57344.0, 40000.0],
    "square_overflows_fp32": [2.0 ** 61],
    # exponent fields 192..254, on the GPU the histogram rows that hold the threshold table:
    # 2^65 (field 192, the first), 2^98 (field 225, E4M3's maximum's threshold), 2^127
    "huge": [2.0 ** 65, 2.0 ** 98, -(2.0 ** 70), 2.0 ** 127],
}


@pytest.mark.parametrize("trigger", list(TRIGGERS))
def test_careful_pass_takes_over(trigger):
    x = ordinary(TILE, torch.float32, seed=1)
    vals = TRIGGERS[trigger]
    x[5: 5 + len(vals)] = torch.tensor(vals)
    assert hist(row_of(x, careful_parts=0)).sum() == 0, (
        "the fast pass kept data it cannot count exactly")
    assert_rows_match(row_of(x), reference_row(x), label=trigger)


def test_only_the_program_that_needs_it_falls_back():
    # four programs of one tile each under the interpreter; the NaN sits in the third
    x = ordinary(TILE * 4, torch.float32, seed=2)
    x[TILE * 2 + 3] = float("nan")
    got = hist(row_of(x, careful_parts=0))
    clean = torch.cat([x[: TILE * 2], x[TILE * 3:]])
    assert torch.equal(got, hist(reference_row(clean)).to(got.dtype))
    assert_rows_match(row_of(x), reference_row(x))


@pytest.mark.parametrize("dname", list(DTYPES))
def test_all_zero_and_near_threshold_values(dname):
    # zeros only; then values on and one step either side of each underflow threshold,
    # subnormal limit and maximum, which the fast pass counts without falling back
    z = torch.zeros(TILE, dtype=DTYPES[dname])
    assert_rows_match(row_of(z), reference_row(z), label="zeros")
    x = ordinary(TILE, torch.float32, seed=3)
    edges = []
    for f in (_E4, _E5, _F16):
        for t in (f.underflow_threshold, f.subnormal_limit, f.max):
            edges += [t, -t, torch.nextafter(torch.tensor(t), torch.tensor(0.0)).item(),
                      torch.nextafter(torch.tensor(t), torch.tensor(1e9)).item()]
    edges = [e for e in edges if not 32768.0 <= abs(e) < 65536.0]  # that bin falls back
    x[: len(edges)] = torch.tensor(edges)
    x = x.to(DTYPES[dname])
    assert_rows_match(row_of(x), reference_row(x), label=dname)
    assert hist(row_of(x, careful_parts=0)).sum() > 0, "fell back"


@pytest.mark.parametrize("dname", ["bf16", "fp16"])
def test_every_16_bit_value_near_the_thresholds(dname):
    # every finite value of the format whose exponent field is 100..141 (every threshold but
    # the maxima of [2^15, 2^16), which fall back), both signs: the counts taken from the
    # histogram's threshold table (and, for fp16 input, the per-element subnormal compare)
    # must equal the reference's compares
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dname]
    bits = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16)
    vals = bits.view(dt).float()
    keep = (vals.abs() >= 2.0 ** -27) & (vals.abs() < 2.0 ** 15) & vals.isfinite()
    v = vals[keep]
    x = torch.cat([v, -v])
    x = torch.cat([x, torch.zeros(-len(x) % TILE)]).to(dt)
    assert_rows_match(row_of(x), reference_row(x), label=dname)
    assert hist(row_of(x, careful_parts=0)).sum() > 0, "fell back"


@pytest.mark.parametrize("scale", [1.0, 448.0 / 3, 2.0 ** -12, 1e30, torch.tensor(0.37)],
                         ids=["1", "448/3", "2^-12", "1e30", "tensor0.37"])
@pytest.mark.parametrize("dname", ["e4m3", "e5m2"])
def test_fp8_byte_counts_give_the_row(dname, scale):
    # every byte value (NaN, +-Inf for e5m2, +-0, subnormals), unevenly often, over two tiles
    # of the interpreter's 8192 fp8 elements: the byte-count pass (tile_fp8.py) at any scale
    g = torch.Generator().manual_seed(4)
    b = torch.randint(0, 256, (TILE * 2,), generator=g, dtype=torch.int64)
    b[:256] = torch.arange(256)
    b[300:2300] = 0x3C  # one value very often
    x = b.to(torch.uint8).view(DTYPES[dname] if dname == "e4m3" else torch.float8_e5m2)
    row = init_row_tensor(x.device)
    launch_row_stats(x, row, scale, Tuning(fast=FastPass.TL_HISTOGRAM, fp8_bytes=True))
    assert_rows_match(row, reference_row(x, scale), label=f"{dname} scale {scale}")


def test_bf16_at_a_two_byte_offset():
    # bf16 is read two values per 32-bit word only from a 4-byte aligned start
    x = ordinary(TILE * 2 + 1, torch.bfloat16, seed=5)[1:]
    assert x.data_ptr() % 4 == 2
    row = row_of(x, careful_parts=0)
    assert hist(row).sum() > 0
    assert_rows_match(row_of(x), reference_row(x))
