"""A capture recorded with another row layout is told apart, not compared field by field."""
import numpy as np
import torch

from stabilitywatch.capture.replay import _reproduce
from stabilitywatch.stats.buffer import StatsFrame
from stabilitywatch.stats.layout import N_STATS
from stabilitywatch.stats.reference import reference_row


def test_replay_refuses_rows_of_another_layout():
    row = reference_row(torch.randn(50)).numpy()
    frame = StatsFrame(step=3, keys=[("fc1", "output")], rows=row[None], scales=[1.0], phases=[0])
    old = row[: N_STATS - 3]  # a row without the shift and the shifted sums
    m = {"stats": {"keys": [["fc1", "output"]], "rows": [old.tolist()]}}
    r = _reproduce(m, frame, setup=None)
    assert r["reproduces"] is False and "another row layout" in r["verdict"]
    same = _reproduce({"stats": {"keys": [["fc1", "output"]], "rows": [row.tolist()]}}, frame,
                      setup=type("S", (), {"device": "cpu"})())
    assert same["reproduces"] is True and np.isfinite(row).sum() > 0
