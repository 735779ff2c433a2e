"""The statistics records of one frame, as the sinks receive them: a row per (module, role),
the global gradient norm, the shadow and optimizer-update rows."""
from __future__ import annotations

import math

import numpy as np

from .detectors.update import ratio_plan, update_records
from .shadow.metrics import shadow_plan, shadow_records
from .stats.frame import PerRowSet, StatsFrame
from .stats.layout import Stat


def _grad_rows(keys) -> np.ndarray:
    return np.asarray([i for i, (_, r) in enumerate(keys) if r == "grad" or r.startswith("grad.")],
                      dtype=np.int64)


def _plan(keys) -> tuple:
    return _grad_rows(keys), shadow_plan(keys), ratio_plan(keys)


class FrameRecords:
    """frame_records, with what it works out from a frame's keys kept per row set."""

    def __init__(self):
        self._plans = PerRowSet(_plan)   # (gradient rows, shadow plan, update-ratio plan)

    def __call__(self, frame: StatsFrame, base: dict) -> list[dict]:
        """base: the fields every record of the frame carries (schema, step, rank...)."""
        recs = [{**base, "module": m, "tensor": r, "stats": d}
                for (m, r), d in zip(frame.keys, frame.derived_rows())]
        grad, shadows, updates = self._plans(frame)
        # frame.rows is host memory (numpy): one array op, no device read
        grad_sq = frame.rows[grad, Stat.SUMSQ].tolist() if len(grad) else []  # sync-ok: numpy
        sent = frame.sentinel
        if grad_sq or sent is not None:
            # the gradient rows on steps that read them, else the sentinel (every step)
            norm = {"l2norm": math.sqrt(sum(grad_sq)) if grad_sq else sent.grad_norm}
            if sent is not None:
                norm["nonfinite"] = sent.nonfinite_total
                if not grad_sq and frame.world_size > 1:
                    norm["rank_local"] = True   # this rank's gradients (its shards under FSDP)
            recs.append({**base, "module": "", "tensor": "grad_norm", "stats": norm})
        # a frame without shadow or update rows (every unsampled step's) has none of theirs
        if shadows:
            recs += shadow_records(frame, base, shadows)
        if updates:
            recs += update_records(frame, base, updates)
        return recs


def frame_records(frame: StatsFrame, base: dict) -> list[dict]:
    """The records of one frame (FrameRecords, for a single frame)."""
    return FrameRecords()(frame, base)
