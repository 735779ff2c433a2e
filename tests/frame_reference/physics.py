"""Physics: a weight cannot move further between two reads than its optimizer could have moved it.

Between the reads of a parameter at steps s0 < s1 (weights are read at step start, so the
optimizer steps s0 .. s1-1 lie between them) every element moved at most
- Adam / AdamW: lr * C + lr * weight_decay * absmax per step, C = (1 - b1) / sqrt(1 - b2) /
  sqrt(1 - b1^2 / b2) (Cauchy-Schwarz on m / sqrt(v); bias correction only lowers it; 7.3 for
  the default betas);
- SGD: lr * (|g| + weight_decay * absmax), with momentum mu the buffer's absmax at s0 decayed
  plus (1 - dampening) / (1 - mu) times the gradients', so the gradient's absmax must have been
  read on every step in between (the every-step sentinel, `frame.sentinel`, or every step
  sampled);
and a tensor's max and min move by no more than its largest element does. A max or min that
moved more than `update.weight_margin` times that bound was written by something other than the
optimizer: a bad write or silent data corruption (critical, stat `update_bound`). The learning
rate comes from the optimizer's param_groups on the host, the largest seen while the frames of
s0 .. s1 were judged (a scheduler that lowers it does not shrink the bound); a tensor lr is read
only from CPU memory (a device lr would need a sync: that group is not checked). Other
optimizers are not checked.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Optional

import torch

from stabilitywatch.alert import Alert, Severity
from stabilitywatch.config import Config
from stabilitywatch.hooks.taps import param_role
from stabilitywatch.stats.buffer import StatsFrame
from stabilitywatch.stats.layout import Stat
from stabilitywatch.detectors.base import Detector


def _kind(opt) -> Optional[str]:
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    if isinstance(opt, torch.optim.SGD):
        return "sgd"
    return None


def _lr(group) -> Optional[float]:
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor):
        if lr.device.type != "cpu" or lr.numel() != 1:
            return None
        lr = lr.item()   # host memory: no device sync
    try:
        lr = float(lr)
    except (TypeError, ValueError):
        return None
    return lr if math.isfinite(lr) and lr >= 0 else None


def _put(store: dict, key, step: int, value: float, keep: int = 64) -> None:
    d = store.setdefault(key, {})
    d[step] = max(value, d.get(step, 0.0))
    if len(d) > keep:
        for s in sorted(d)[:-keep]:
            del d[s]


def adam_bound(betas) -> Optional[float]:
    """The most |m / sqrt(v)| can be for any gradient sequence (None when b1^2 >= b2)."""
    try:
        b1, b2 = float(betas[0]), float(betas[1])
    except (TypeError, ValueError, IndexError):
        return None
    if not (0 <= b1 < 1 and 0 < b2 < 1) or b1 * b1 >= b2:
        return None
    return (1 - b1) / math.sqrt(1 - b2) / math.sqrt(1 - b1 * b1 / b2)


class PhysicsDetector(Detector):
    name = "physics"

    def __init__(self, config: Config, optimizer, modules: list):
        self.margin = config.update.weight_margin
        self.opt = optimizer
        self.kind = _kind(optimizer)
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.params: dict[tuple[str, str], tuple[int, str]] = {}   # (module, role) -> (group, grad role)
        seen: set[int] = set()
        for name, mod in modules:
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) in seen or id(p) not in group_of:
                    continue
                seen.add(id(p))
                self.params[(name, param_role(pname, "weight"))] = (group_of[id(p)],
                                                                   param_role(pname, "grad"))
        self._by_grad = {(m, g): (m, r) for (m, r), (_, g) in self.params.items()}
        self._last: dict[tuple[str, str], tuple[int, float, float, float]] = {}
        self._lrs: deque = deque(maxlen=4096)                 # (step, per-group lr)
        self._grads: dict[tuple[str, str], dict[int, float]] = {}   # SGD: step -> grad absmax
        self._bufs: dict[tuple[str, str], dict[int, float]] = {}    # SGD: step -> momentum absmax
        self._lr_cache: dict = {}

    def check(self, frame: StatsFrame) -> list[Alert]:
        if self.kind is None or not self.params:
            return []
        self._lrs.append((frame.step, [_lr(g) for g in self.opt.param_groups]))
        rows = {k: i for i, k in enumerate(frame.keys)}
        if self.kind == "sgd":
            self._remember(frame, rows)
        out = []
        self._lr_cache: dict = {}
        for key, (gi, _) in self.params.items():
            i = rows.get(key)
            if i is None:
                continue
            r = frame.rows[i]
            if r[Stat.NAN] + r[Stat.POSINF] + r[Stat.NEGINF] > 0 or r[Stat.NUMEL] == 0:
                self._last.pop(key, None)   # the nonfinite detector's; start again when clean
                continue
            cur = (frame.step, float(r[Stat.MAX]), float(r[Stat.MIN]), float(r[Stat.ABSMAX]))
            prev = self._last.get(key)
            self._last[key] = cur
            if prev is None or cur[0] <= prev[0]:
                continue
            a = self._judge(frame, key, gi, prev, cur)
            if a is not None:
                out.append(a)
        return out

    def _remember(self, frame, rows) -> None:
        sent = getattr(frame, "sentinel", None)
        if sent is not None:   # every step: each gradient's absmax, read before the update
            for j, gkey in enumerate(sent.keys):
                key = self._by_grad.get(tuple(gkey))
                if key is not None and sent.present[j] and sent.nonfinite[j] == 0:
                    _put(self._grads, key, frame.step, float(sent.absmax[j]))
        for key, (_, grole) in self.params.items():
            module, role = key
            # a parameter's role is its name (weight, bias...): param_role maps names
            for store, r in ((self._grads, grole),
                             (self._bufs, param_role(role, "optim.momentum_buffer"))):
                i = rows.get((module, r))
                if i is not None:
                    _put(store, key, frame.step, float(frame.rows[i][Stat.ABSMAX]))

    def _lr_max(self, gi: int, s0: int) -> Optional[float]:
        hit = self._lr_cache.get((gi, s0), self)
        if hit is not self:
            return hit
        self._lr_cache[(gi, s0)] = best = self._scan_lr(gi, s0)
        return best

    def _scan_lr(self, gi: int, s0: int) -> Optional[float]:
        best = None
        for step, lrs in reversed(self._lrs):
            lr = lrs[gi] if gi < len(lrs) else None
            if lr is None:
                return None
            best = lr if best is None else max(best, lr)
            if step <= s0:
                break
        return best

    def _bound(self, key, gi, s0, s1, absmax) -> Optional[tuple[float, float, str]]:
        group = self.opt.param_groups[gi]
        lr = self._lr_max(gi, s0)
        if lr is None:
            return None
        wd = float(group.get("weight_decay", 0.0) or 0.0)
        n = s1 - s0
        if self.kind == "adam":
            c = adam_bound(group.get("betas", (0.9, 0.999)))
            if c is None:
                return None
            # |w| may grow by n * lr * c between the reads before it decays
            return n * lr * (c + wd * (absmax + n * lr * c)), lr, \
                f"{type(self.opt).__name__} (at most " \
                f"{c:.3g} x lr per element per step)"
        grads, bufs = self._grads.get(key, {}), self._bufs.get(key, {})
        if any(s not in grads for s in range(s0, s1)):
            return None
        gmax = max(grads[s] for s in range(s0, s1))
        g = gmax + wd * (absmax + n * lr * gmax)
        mu = float(group.get("momentum", 0.0) or 0.0)
        if mu == 0:
            per = g
        else:
            if s0 - 1 not in bufs and s0 > 0 or not 0 < mu < 1:
                return None
            damp = float(group.get("dampening", 0.0) or 0.0)
            per = bufs.get(s0 - 1, 0.0) + (1 - damp) * g / (1 - mu)
            if group.get("nesterov"):
                per = g + mu * per
        return n * lr * per, lr, "SGD (lr x gradient)"

    def _judge(self, frame, key, gi, prev, cur) -> Optional[Alert]:
        s0, mx0, mn0, am0 = prev
        s1, mx1, mn1, am1 = cur
        # weight decay shrinks by lr * wd * |w| of the weight before the write: the earlier read
        got = self._bound(key, gi, s0, s1, am0)
        if got is None:
            return None
        bound, lr, how = got
        dmax, dmin = abs(mx1 - mx0), abs(mn1 - mn0)
        moved = max(dmax, dmin)
        limit = self.margin * bound
        if not moved > limit:
            return None
        module, role = key
        stat, (a, b) = ("max", (mx0, mx1)) if dmax >= dmin else ("min", (mn0, mn1))
        bits = math.log2(am1 / am0) if am0 > 0 and am1 > 0 else math.inf
        msg = (f"{role} of {module or '<model>'}: {stat} {a:.4g} -> {b:.4g} between the reads at "
               f"steps {s0} and {s1} (absmax {am0:.4g} -> {am1:.4g}, {bits:+.1f} bits), but "
               f"{how} at lr {lr:.3g} moves an element at most {bound:.3g} in {s1 - s0} "
               f"step(s): a bad write or silent data corruption (something other than the "
               f"optimizer changed this {role}; {moved / bound:.3g}x the bound)")
        return Alert(step=frame.step, detector=self.name, severity=Severity.CRITICAL,
                     module=module, tensor=role, stat="update_bound", value=moved,
                     threshold=limit, message=msg, rank=frame.rank,
                     extra={"bits": bits if math.isfinite(bits) else None, "previous_step": s0, "bound": bound, "lr": lr,
                            "absmax": am1, "previous_absmax": am0})
