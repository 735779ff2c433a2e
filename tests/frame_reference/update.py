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

from stabilitywatch.alert import Alert, Severity
from stabilitywatch.config import Config
from stabilitywatch.stats.buffer import StatsFrame
from stabilitywatch.stats.layout import Stat
from stabilitywatch.detectors.base import Detector
from stabilitywatch.detectors.series import Window, log2_or_none


UPDATE = "optim.update"


def _weight_role(update_role: str) -> str:
    # optim.update -> weight, optim.update.bias -> bias (hooks/taps.param_role)
    return "weight" if update_role == UPDATE else update_role[len(UPDATE) + 1:]


def update_ratios(frame: StatsFrame) -> dict[str, tuple[float, float, float]]:
    """{module: (||dW|| / ||W||, ||dW||, ||W||)} over the module's parameters with both rows."""
    weight_sq = {}
    upd: dict[str, list] = {}
    sumsq = frame.rows[:, Stat.SUMSQ].tolist()   # one array op: indexing rows one by one is slow
    for (m, r), sq in zip(frame.keys, sumsq):
        if r == UPDATE or r.startswith(UPDATE + "."):
            upd.setdefault(m, []).append((_weight_role(r), sq))
        else:
            weight_sq[(m, r)] = sq
    out = {}
    for m, parts in upd.items():
        du = sum(v for r, v in parts if (m, r) in weight_sq)
        w = sum(weight_sq[(m, r)] for r, _ in parts if (m, r) in weight_sq)
        if w > 0:
            out[m] = (math.sqrt(du / w), math.sqrt(du), math.sqrt(w))
    return out


def update_records(frame: StatsFrame, base: dict) -> list[dict]:
    """stats.jsonl records of the update ratios of one frame (module, tensor "update_ratio")."""
    return [{**base, "module": m, "tensor": "update_ratio",
             "stats": {"update_ratio": r, "update_l2norm": du, "weight_l2norm": w}}
            for m, (r, du, w) in update_ratios(frame).items()]


class UpdateDetector(Detector):
    name = "spike"

    def __init__(self, config: Config):
        self.cfg = config
        self._win: dict[str, Window] = {}

    def check(self, frame: StatsFrame) -> list[Alert]:
        out = []
        cfg = self.cfg
        for m, (ratio, du, w) in update_ratios(frame).items():
            x = log2_or_none(ratio)
            if x is None:
                continue
            win = self._win.get(m)
            if win is None:
                win = self._win[m] = Window(cfg.update.window)
            if len(win) >= cfg.update.min_history:
                med, sigma = win.noise()
                # a warm-up raises the ratio steadily: judge a jump against the recent level
                # too (the higher of the two), not only the window's lagging median
                med = max(med, win.recent(cfg.spike.loss_recent))
                thr = max(cfg.update.spike_bits, cfg.spike.z * sigma)
                if x - med > thr:
                    msg = (f"optimizer update of {m or '<model>'}: ||dW|| / ||W|| = {ratio:.3g} is "
                           f"x{2 ** (x - med):.1f} its level {2 ** med:.3g} (the higher median "
                           f"of the last {len(win)} and the last {cfg.spike.loss_recent} sampled "
                           f"steps; threshold x{2 ** thr:.1f}); update-norm "
                           f"spikes precede loss spikes: check the learning rate, the gradient "
                           f"and the optimizer state of this module")
                    out.append(Alert(step=frame.step, detector=self.name,
                                     severity=Severity.WARNING, module=m, tensor=UPDATE,
                                     stat="update_ratio", value=ratio,
                                     threshold=2 ** (med + thr), message=msg, rank=frame.rank,
                                     extra={"median": 2 ** med, "update_l2norm": du,
                                            "weight_l2norm": w}))
            win.push(x)
        return out
