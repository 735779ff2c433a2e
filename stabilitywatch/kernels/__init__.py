"""Triton kernels. Triton is imported only inside this package, and only on demand: the rest of
stabilitywatch imports and runs (on the pure-torch reference) without it."""
from .dispatch import accumulate, compute_row, flat_view, triton_usable

__all__ = ["accumulate", "compute_row", "flat_view", "triton_usable"]
