"""Spikes: the loss, gradient norms (global and per layer), attention-logit growth and output-logit
divergence (Wortsman et al. 2023, arXiv 2309.14322).

- loss (module "", every step): spike when loss - level > max(spike.z * noise,
  spike.loss_rel * |level|), level being the lower of the median of the previous `spike.window`
  losses and the median of the last `spike.loss_recent` (the recent trend: early in training the
  window's median lags far above a falling loss), noise the step-to-step scale 1.4826 *
  MAD(successive differences about their median) / sqrt(2) (a falling loss does not inflate it);
- gradient norms (on steps that read gradients): the global L2 norm (module "", role
  `grad_norm`, the same number as stats.jsonl) and each module's, in log2: spike when
  log2(g) - median > max(spike.z * noise, spike.grad_bits or, per layer,
  spike.layer_grad_bits). Per-layer spikes are info alerts (one small module's norm - a
  LayerNorm, a bias - is too noisy for a warning), and the global alert names the layer with
  the largest jump;
- attention logits (role `attn_logits`, see hooks/logits.py): warning when max |logit| passes
  `spike.attn_logit_max`, or has grown `spike.attn_growth_bits` above the median of its first
  `spike.min_history` samples while above `spike.attn_floor`;
- output logits (role `logz`): warning when mean log Z moved `spike.logz_drift` nats from the
  median of its first `spike.min_history` samples.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..alert import Alert, Severity
from ..config import Config
from ..stats.buffer import StatsFrame
from ..stats.derive import finite_count
from ..stats.frame import PerRowSet
from ..stats.layout import Stat
from .base import Detector
from .series import Rings, Window, log2_or_none


def is_grad_role(role: str) -> bool:
    return role == "grad" or role.startswith("grad.")


def grad_rows(keys) -> tuple[list, list]:
    """(modules, each one's parameter-gradient rows) of a row set, modules in row order."""
    groups: dict[str, list] = {}
    for i, (m, r) in enumerate(keys):
        if is_grad_role(r):
            groups.setdefault(m, []).append(i)
    return list(groups), list(groups.values())


def grad_norms(frame: StatsFrame, groups: Optional[list] = None) -> tuple[float, list]:
    """(global L2 norm, each module's L2 norm, modules as grad_rows gives them) of the parameter
    gradients in the frame (NaN global when there are none). Non-finite values are not in the
    sums (the nonfinite detector's)."""
    if groups is None:
        groups = grad_rows(frame.keys)[1]
    sq = frame.rows[:, Stat.SUMSQ].tolist() if groups else []  # sync-ok: host numpy
    per = []
    for ix in groups:
        v = 0.0
        for i in ix:
            v = v + sq[i]
        per.append(v)
    total = math.sqrt(sum(per)) if per else math.nan
    return total, [math.sqrt(v) for v in per]


class SpikeDetector(Detector):
    name = "spike"

    def __init__(self, config: Config):
        self.cfg = config
        self._win: dict[tuple[str, str], Window] = {}
        self._layers = Rings(config.spike.window)        # each module's log2 gradient norm
        self._plans = PerRowSet(self._plan)

    def _plan(self, keys: tuple) -> tuple:
        mods, groups = grad_rows(keys)
        logits = [(j, m, r) for j, (m, r) in enumerate(keys) if r in ("attn_logits", "logz")]
        return mods, groups, self._layers.rows([(m, "grad") for m in mods]), logits

    def _window(self, key) -> Window:
        w = self._win.get(key)
        if w is None:
            w = self._win[key] = Window(self.cfg.spike.window, early=self.cfg.spike.min_history)
        return w

    def _idle_on(self, keys: tuple) -> bool:
        # no gradient rows, no loss, no logits: check() judges nothing and pushes nothing
        return not any(is_grad_role(r) or r in ("attn_logits", "logz") or (m, r) == ("", "loss")
                       for m, r in keys)

    def check(self, frame: StatsFrame) -> list[Alert]:
        out: list[Alert] = []
        mods, groups, series, logits = self._plans(frame)
        if mods:
            total, per = grad_norms(frame, groups)
            out += self._grad_spikes(frame, total, mods, per, series)
        i = frame.index("", "loss")
        if i is not None:
            row = frame.rows[i]
            n = finite_count(row)
            if n > 0 and row[Stat.NAN] + row[Stat.POSINF] + row[Stat.NEGINF] == 0:
                a = self._loss(frame, float(row[Stat.SUM]) / n)
                if a:
                    out.append(a)
        for j, m, r in logits:
            if r == "attn_logits":
                a = self._attn(frame, m, frame.column("absmax")[j])
            else:
                a = self._logz(frame, m, frame.column("mean")[j])
            if a:
                out.append(a)
        return out

    # -- loss -----------------------------------------------------------------------------------
    def _loss(self, frame, loss):
        cfg, w = self.cfg, self._window(("", "loss"))
        alert = None
        if len(w) >= cfg.spike.min_history:
            med = w.median()
            # while the loss falls (early training) the window's median lags far above it:
            # judge against the recent level too, whichever is lower
            recent = w.recent(cfg.spike.loss_recent)
            base = min(med, recent)
            floor = max(cfg.spike.loss_rel * abs(base), 1e-12)
            # the noise term (two more sorts) can only raise the threshold above the floor:
            # worked out only for a loss past the floor
            thr = max(cfg.spike.z * w.noise()[1], floor) if loss - base > floor else floor
            if loss - base > thr:
                level = (f"its median {med:.4g} over the last {len(w)} steps" if base == med else
                         f"its recent level {recent:.4g} (median of the last "
                         f"{min(len(w), cfg.spike.loss_recent)} steps; {med:.4g} over the last "
                         f"{len(w)})")
                msg = (f"loss {loss:.4g} is {loss - base:.3g} above {level} (threshold "
                       f"+{thr:.3g}: max({cfg.spike.z:g} robust sigma, {cfg.spike.loss_rel:g} x "
                       f"|level|))")
                alert = Alert(step=frame.step, detector=self.name, severity=Severity.WARNING,
                              module="", tensor="loss", stat="loss", value=loss,
                              threshold=base + thr, message=msg, rank=frame.rank,
                              extra={"median": med, "recent": recent})
        w.push(loss)
        return alert

    # -- gradient norms ---------------------------------------------------------------------------
    def _jump(self, key, value, min_bits):
        """(bits above the median, threshold in bits, median) or None; pushes the value."""
        x = log2_or_none(value)
        if x is None:
            return None
        w, res = self._window(key), None
        if len(w) >= self.cfg.spike.min_history:
            med, sigma = w.noise()
            thr = max(self.cfg.spike.z * sigma, min_bits)
            res = (x - med, thr, 2.0 ** med)
        w.push(x)
        return res

    def _grad_spikes(self, frame, total, mods, per, series):
        cfg = self.cfg.spike
        ok = [j for j, g in enumerate(per) if g > 0 and math.isfinite(g)]   # log2_or_none
        layer = {}
        if ok:
            rows, x = series[ok], np.array([math.log2(per[j]) for j in ok])
            ready = np.flatnonzero(self._layers.count[rows] >= cfg.min_history)
            # as _jump, for every module at once; the threshold is at least layer_grad_bits,
            # so the noise (two more sorts) is worked out only where the jump passes that
            near = ready[x[ready] - self._layers.median(rows[ready]) > cfg.layer_grad_bits]
            if len(near):
                med, sigma = self._layers.noise(rows[near])
                thr = np.maximum(cfg.z * sigma, cfg.layer_grad_bits)
                dev = x[near] - med
                for k in np.flatnonzero(dev > thr).tolist():  # sync-ok: host numpy
                    j = ok[int(near[k])]
                    layer[mods[j]] = (per[j], (float(dev[k]), float(thr[k]),
                                               2.0 ** float(med[k])))
            self._layers.push(rows, x)
        out = []
        j = self._jump(("", "grad_norm"), total, self.cfg.spike.grad_bits)
        global_spike = j is not None and j[0] > j[1]
        if global_spike:
            top = max(layer, key=lambda m: layer[m][1][0], default=None)
            where = (f"; largest per-layer jump: {top} (x{2 ** layer[top][1][0]:.1f})"
                     if top is not None else "")
            msg = (f"global gradient norm {total:.4g} is x{2 ** j[0]:.1f} its median "
                   f"{j[2]:.4g} over the last {len(self._win[('', 'grad_norm')]) - 1} samples "
                   f"(threshold x{2 ** j[1]:.1f}){where}")
            out.append(Alert(step=frame.step, detector=self.name, severity=Severity.WARNING,
                             module="", tensor="grad_norm", stat="l2norm", value=total,
                             threshold=j[2] * 2 ** j[1], message=msg, rank=frame.rank,
                             extra={"layers": sorted(layer)}))
        for m, (g, (dev, thr, med)) in layer.items():
            sev = Severity.INFO
            msg = (f"gradient norm of {m} {g:.4g} is x{2 ** dev:.1f} its median {med:.4g} "
                   f"(threshold x{2 ** thr:.1f})"
                   + ("; the global norm spiked too" if global_spike else ""))
            out.append(Alert(step=frame.step, detector=self.name, severity=sev, module=m,
                             tensor="grad", stat="l2norm", value=g, threshold=med * 2 ** thr,
                             message=msg, rank=frame.rank,
                             extra={"bits": dev, "change_point": True}))
        return out

    # -- attention and output logits -----------------------------------------------------------
    def _attn(self, frame, module, amax):
        cfg, w = self.cfg, self._window((module, "attn_logits"))
        if not (amax > 0 and math.isfinite(amax)):
            return None
        w.push(math.log2(amax))
        base = 2.0 ** w.baseline if not math.isnan(w.baseline) else math.nan
        grown = (not math.isnan(base) and amax >= cfg.spike.attn_floor
                 and math.log2(amax / base) >= cfg.spike.attn_growth_bits)
        if amax <= cfg.spike.attn_logit_max and not grown:
            return None
        why = (f"above {cfg.spike.attn_logit_max:g}" if amax > cfg.spike.attn_logit_max else
               f"x{amax / base:.1f} its early median {base:.3g} (threshold "
               f"x{2 ** cfg.spike.attn_growth_bits:g} above {cfg.spike.attn_floor:g})")
        msg = (f"attention-logit growth: max |q.k|/sqrt(d) = {amax:.4g}, {why}; large attention "
               f"logits collapse the softmax to one-hot and precede divergence (Wortsman et al. "
               f"2023); qk-layernorm or a lower learning rate keeps them bounded")
        return Alert(step=frame.step, detector=self.name, severity=Severity.WARNING,
                     module=module, tensor="attn_logits", stat="absmax", value=amax,
                     threshold=cfg.spike.attn_logit_max if amax > cfg.spike.attn_logit_max
                     else base * 2 ** cfg.spike.attn_growth_bits, message=msg, rank=frame.rank,
                     extra={"early_median": base})

    def _logz(self, frame, module, mean):
        cfg, w = self.cfg, self._window((module, "logz"))
        if not math.isfinite(mean):
            return None
        w.push(mean)
        if math.isnan(w.baseline) or abs(mean - w.baseline) <= cfg.spike.logz_drift:
            return None
        msg = (f"output-logit divergence: mean log Z {mean:.4g} moved {mean - w.baseline:+.3g} "
               f"nats from its early median {w.baseline:.4g} (threshold {cfg.spike.logz_drift:g}); "
               f"a z-loss (1e-4 * log Z^2) keeps it near 0 (Wortsman et al. 2023)")
        return Alert(step=frame.step, detector=self.name, severity=Severity.WARNING,
                     module=module, tensor="logz", stat="mean", value=mean,
                     threshold=cfg.spike.logz_drift, message=msg, rank=frame.rank,
                     extra={"early_median": w.baseline})
