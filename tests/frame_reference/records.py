"""The statistics records of one frame, as the sinks receive them: a row per (module, role),
the global gradient norm, the shadow and optimizer-update rows."""
from __future__ import annotations

import math

from .update import update_records
from .shadow_metrics import shadow_records
from stabilitywatch.stats.frame import StatsFrame
from stabilitywatch.stats.layout import Stat


def frame_records(frame: StatsFrame, base: dict) -> list[dict]:
    """base: the fields every record of the frame carries (schema, step, rank...)."""
    derived = frame.derived
    recs = [dict(base, module=m, tensor=r, stats=derived(i))
            for i, (m, r) in enumerate(frame.keys)]
    grad = [i for i, (_, r) in enumerate(frame.keys) if r == "grad" or r.startswith("grad.")]
    # frame.rows is host memory (numpy): one array op, no device read
    grad_sq = frame.rows[grad, Stat.SUMSQ].tolist() if grad else []  # sync-ok: numpy
    sent = frame.sentinel
    if grad_sq or sent is not None:
        # the gradient rows on steps that read them, else the sentinel (every step)
        norm = {"l2norm": math.sqrt(sum(grad_sq)) if grad_sq else sent.grad_norm}
        if sent is not None:
            norm["nonfinite"] = sent.nonfinite_total
            if not grad_sq and frame.world_size > 1:
                norm["rank_local"] = True   # this rank's gradients (its shards under FSDP)
        recs.append({**base, "module": "", "tensor": "grad_norm", "stats": norm})
    return recs + shadow_records(frame, base) + update_records(frame, base)
