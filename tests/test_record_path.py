"""The record path's launch reads a contiguous tensor of any shape through its first element:
no flat view is made for it, and the rows are the flat view's, bit for bit (the interpreter
runs the same programs in the same order)."""
import pytest
import torch

from stabilitywatch.kernels.stats_triton import run_row_stats
from stabilitywatch.stats.layout import init_row_tensor


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(2, 4146), (3, 5), (1, 1, 8192), ()],
                         ids=["tile+tail", "tail", "tile", "scalar"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_contiguous_tensor_of_any_shape_gives_its_flat_views_row(shape, dtype):
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(shape, generator=g) * 100).to(dtype)
    t.view(-1)[::97] = float("inf")   # the first element too: the row's shift is not finite
    got, want = init_row_tensor("cpu"), init_row_tensor("cpu")
    run_row_stats(t, got, 0.25, None, None)
    run_row_stats(t.reshape(-1), want, 0.25, None, None)
    assert torch.equal(got, want)
    assert got[0].item() == t.numel()
