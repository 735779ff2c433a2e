"""Statistics rows: layout, pure-torch reference, host-side derived values."""
from .layout import HIST_BINS, HIST_EMIN, N_STATS, Stat, init_row, merge_rows
from .reference import reference_row

__all__ = ["HIST_BINS", "HIST_EMIN", "N_STATS", "Stat", "init_row", "merge_rows", "reference_row"]
