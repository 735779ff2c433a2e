"""Spikes in the optimizer's relative update ||dW|| / ||W|| per module (role `optim.update`, on
sampled steps by hooks/update.py; W is the weight at the step's start, from its `weight` rows).

Large Adam update-norm spikes come before loss and gradient-norm spikes in large runs. Per
module, log2 of the ratio is judged against its level, the higher of the medians of its last
`update.window` and last `spike.loss_recent` samples (a warm-up raises it steadily): a
warning when it is more than max(`update.spike_bits`, spike.z x the step-to-step noise) bits
above (x8 by default). Updates of zero (a skipped step, a frozen module) are not judged.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..alert import Alert, Severity
from ..config import Config
from ..stats.buffer import StatsFrame
from ..stats.frame import PerRowSet
from ..stats.layout import Stat
from .base import Detector
from .series import Rings


UPDATE = "optim.update"


def _weight_role(update_role: str) -> str:
    # optim.update -> weight, optim.update.bias -> bias (hooks/taps.param_role)
    return "weight" if update_role == UPDATE else update_role[len(UPDATE) + 1:]


def ratio_plan(keys) -> list[tuple[str, list]]:
    """[(module, [(weight row, update row)...])] of a row set: each update row (in row order)
    with the row of its weight (the last row of that (module, role)), modules in row order."""
    last: dict = {}
    upd: dict[str, list] = {}
    for i, (m, r) in enumerate(keys):
        if r == UPDATE or r.startswith(UPDATE + "."):
            upd.setdefault(m, []).append((_weight_role(r), i))
        else:
            last[(m, r)] = i
    return [(m, [(last[(m, r)], u) for r, u in parts if (m, r) in last])
            for m, parts in upd.items()]


def update_ratios(frame: StatsFrame, plan: Optional[list] = None
                  ) -> dict[str, tuple[float, float, float]]:
    """{module: (||dW|| / ||W||, ||dW||, ||W||)} over the module's parameters with both rows
    (worked out once per frame: the detector and the records both read them)."""
    return frame.memo("update_ratios", lambda f: _ratios(f, ratio_plan(f.keys) if plan is None
                                                           else plan))


def _ratios(frame: StatsFrame, plan: list) -> dict:
    if not plan:
        return {}
    sumsq = frame.rows[:, Stat.SUMSQ].tolist()   # sync-ok: host numpy (one array op)
    out = {}
    for m, pairs in plan:
        du = sum(sumsq[u] for _, u in pairs)
        w = sum(sumsq[wi] for wi, _ in pairs)
        if w > 0:
            out[m] = (math.sqrt(du / w), math.sqrt(du), math.sqrt(w))
    return out


def update_records(frame: StatsFrame, base: dict, plan: Optional[list] = None) -> list[dict]:
    """stats.jsonl records of the update ratios of one frame (module, tensor "update_ratio")."""
    return [{**base, "module": m, "tensor": "update_ratio",
             "stats": {"update_ratio": r, "update_l2norm": du, "weight_l2norm": w}}
            for m, (r, du, w) in update_ratios(frame, plan).items()]


class UpdateDetector(Detector):
    name = "spike"

    def __init__(self, config: Config):
        self.cfg = config
        self._rings = Rings(config.update.window)   # each module's log2 update ratio
        self._plans = PerRowSet(ratio_plan)

    def _idle_on(self, keys: tuple) -> bool:
        return not ratio_plan(keys)   # no update row with its weight row: no ratio to judge

    def check(self, frame: StatsFrame) -> list[Alert]:
        cfg = self.cfg
        ratios = update_ratios(frame, self._plans(frame))
        ok = [(m, v, math.log2(v[0])) for m, v in ratios.items()
              if v[0] > 0 and math.isfinite(v[0])]   # log2_or_none
        if not ok:
            return []
        rows = self._rings.rows([m for m, _, _ in ok])
        x = np.array([t[2] for t in ok])
        out = []
        ready = np.flatnonzero(self._rings.count[rows] >= cfg.update.min_history)
        if len(ready):   # Window.noise and .recent for every module at once
            r = rows[ready]
            med, sigma = self._rings.noise(r)
            # a warm-up raises the ratio steadily: judge a jump against the recent level
            # too (the higher of the two), not only the window's lagging median
            med = np.maximum(med, self._rings.recent(r, cfg.spike.loss_recent))
            thr = np.maximum(cfg.update.spike_bits, cfg.spike.z * sigma)
            fire = x[ready] - med > thr
            for k in np.flatnonzero(fire).tolist():  # sync-ok: host numpy
                m, (ratio, du, w), xm = ok[int(ready[k])]
                out.append(self._alert(frame, m, ratio, du, w, xm, float(med[k]),
                                       float(thr[k]), int(self._rings.count[r[k]])))
        self._rings.push(rows, x)
        return out

    def _alert(self, frame, m, ratio, du, w, x, med, thr, n) -> Alert:
        cfg = self.cfg
        msg = (f"optimizer update of {m or '<model>'}: ||dW|| / ||W|| = {ratio:.3g} is "
               f"x{2 ** (x - med):.1f} its level {2 ** med:.3g} (the higher median "
               f"of the last {n} and the last {cfg.spike.loss_recent} sampled "
               f"steps; threshold x{2 ** thr:.1f}); update-norm "
               f"spikes precede loss spikes: check the learning rate, the gradient "
               f"and the optimizer state of this module")
        return Alert(step=frame.step, detector=self.name, severity=Severity.WARNING, module=m,
                     tensor=UPDATE, stat="update_ratio", value=ratio,
                     threshold=2 ** (med + thr), message=msg, rank=frame.rank,
                     extra={"median": 2 ** med, "update_l2norm": du, "weight_l2norm": w})
