"""NaN/Inf anywhere: one critical alert naming where they first appear in execution order.

Two sources: the statistics rows (the tensors read at this step: every role on sampled steps,
the loss on the others) and the sentinel (every parameter gradient, every step, in backward
order: stats/sentinel.py). On an unsampled step a non-finite gradient is named from the
sentinel (the first gradient in backward order that holds NaN/Inf); a non-finite loss there
means the values appeared in the forward of that step (the loss and every gradient follow), and
the alert says "forward": the escalated steps (schedule.py) or the guard's re-run name the module.
"""
from __future__ import annotations

import numpy as np

from ..alert import Alert, Severity
from ..stats.buffer import Phase, StatsFrame
from ..stats.layout import Stat
from .base import Detector

_READ_BEFORE_LOSS = (Phase.BATCH, Phase.WEIGHT, Phase.FORWARD)
_SMALL = 2   # frames of at most this many rows (an unsampled step's) are checked row by row
_NAN, _POSINF, _NEGINF = int(Stat.NAN), int(Stat.POSINF), int(Stat.NEGINF)


def _counts(row) -> tuple[float, float]:
    return float(row[Stat.NAN]), float(row[Stat.POSINF] + row[Stat.NEGINF])


def _where(module: str) -> str:
    return module or "<model>"


class NonFiniteDetector(Detector):
    """Critical on the step where non-finite values appear, naming the first tensor in execution
    order (batch, weights, forward, loss, backward, gradients in backward order, optimizer
    state) that holds them: every tensor read before it was finite, so its inputs were. While
    they persist, one warning every `remind_every` steps instead of a critical alert each step."""

    name = "nonfinite"

    def __init__(self, remind_every: int = 50):
        self.remind_every = remind_every
        self._episode_start: int | None = None
        self._last_reminder = 0
        # the episode's first alert could not name a module (the forward of an unsampled step,
        # another rank): the first later frame that can, inside the episode, names it
        self._vague = False

    def check(self, frame: StatsFrame) -> list[Alert]:
        # shadow.* rows are measurements of a replica, not tensors of the training step
        rows = frame.rows
        n = len(frame.keys)
        if n > _SMALL or (n and rows.dtype != np.float64):
            # one array op over the frame; Python only for the rows that hold any
            hit = np.flatnonzero(rows[:, Stat.NAN] + (rows[:, Stat.POSINF] + rows[:, Stat.NEGINF])
                                 > 0).tolist()  # sync-ok: host numpy
        elif n:   # the loss row alone: the same float64 sums on Python floats
            hit = [i for i, r in enumerate(rows.tolist())   # sync-ok: host numpy
                   if r[_NAN] + (r[_POSINF] + r[_NEGINF]) > 0]
        else:
            hit = []
        bad = [i for i in hit if not frame.keys[i][1].startswith("shadow.")]
        sent = frame.sentinel
        s_bad = sent.first_bad() if sent is not None else None
        other_rank = (sent is not None and s_bad is None and bool(sent.any_rank_bad))
        if not bad and s_bad is None and not other_rank:
            self._episode_start = None
            return []
        found = self._origin(frame, bad, s_bad, other_rank)
        module, role, nan, inf, numel, origin, extra = found
        stat, value = ("nan", nan) if nan >= inf else ("inf", inf)
        rank = extra["ranks"][0] if extra.get("ranks") else frame.rank
        n_bad = len(bad) + (int((sent.nonfinite > 0).sum()) if sent is not None else 0)
        vague = (extra.get("phase") == "forward" and not extra.get("sampled")) \
            or bool(extra.get("other_rank"))
        if self._episode_start is None:
            self._episode_start = self._last_reminder = frame.step
            self._vague = vague
            # another rank's gradient named by the cross-rank flags: its counts stay there
            counts = "NaN/Inf" if extra.get("source") == "cross_rank_flags" else \
                f"{int(nan)} NaN and {int(inf)} Inf of {int(numel)} values"
            msg = f"{counts} first appear in {origin}{self._spread(frame, bad, found)}"
            return [Alert(step=frame.step, detector=self.name, severity=Severity.CRITICAL,
                          module=module, tensor=role, stat=stat, value=value, threshold=0.0,
                          message=msg, rank=rank, extra=extra)]
        # a later step names the module only while the weights are clean (the guard skipped
        # the bad updates): non-finite weights are the bad step's update, not its origin
        if self._vague and not vague and extra.get("phase") != "weight":
            self._vague = False
            msg = (f"non-finite values since step {self._episode_start} (whose alert could not "
                   f"name the module): at step {frame.step}, {int(nan)} NaN and {int(inf)} Inf "
                   f"of {int(numel)} values first appear in {origin}"
                   f"{self._spread(frame, bad, found)}")
            return [Alert(step=frame.step, detector=self.name, severity=Severity.CRITICAL,
                          module=module, tensor=role, stat=stat, value=value, threshold=0.0,
                          message=msg, rank=frame.rank,
                          extra={**extra, "refines_step": self._episode_start})]
        if frame.step - self._last_reminder >= self.remind_every:
            self._last_reminder = frame.step
            msg = (f"non-finite values persist since step {self._episode_start} "
                   f"({n_bad} tensors affected; first in execution order: {origin})")
            return [Alert(step=frame.step, detector=self.name, severity=Severity.WARNING,
                          module=module, tensor=role, stat=stat, value=value, threshold=0.0,
                          message=msg, rank=rank, extra=extra)]
        return []

    # -- where they first appear ---------------------------------------------------------------
    def _origin(self, frame, bad, s_bad, other_rank):
        """(module, role, nan, inf, numel, origin text, alert extra)."""
        sent = frame.sentinel
        read_fwd = any(ph in _READ_BEFORE_LOSS for ph in frame.phases)
        if bad:
            first = bad[0]
            module, role = frame.keys[first]
            phase = frame.phases[first]
            if phase >= Phase.GRAD and s_bad is not None:
                return self._from_sentinel(frame, s_bad)   # backward order, not slot order
            nan, inf = _counts(frame.rows[first])
            numel = float(frame.rows[first][Stat.NUMEL])
            if role == "loss" and not read_fwd:
                return self._forward(frame, nan, inf, numel)
            return (module, role, nan, inf, numel, self._origin_text(frame, first, module, role),
                    {"phase": _PHASE_NAMES.get(phase, "step"), "sampled": read_fwd})
        if s_bad is not None:
            return self._from_sentinel(frame, s_bad)
        # the sentinel is finite here but the cross-rank flag says another rank's is not
        named = _other_rank_gradient(sent)
        if named is not None:
            return named
        r = sent.bad_rank
        who = f"rank {r}" if r is not None else "another rank"
        extra = {"phase": "backward", "other_rank": True}
        if r is not None:
            extra["ranks"] = [r]
        return ("", "grad", 0.0, 0.0, 0.0,
                f"the gradients of {who} (this rank's were finite; the guard's cross-rank flag "
                f"said so; the next steps read on every rank name the tensor)", extra)

    @staticmethod
    def _forward(frame, nan, inf, numel):
        sent = frame.sentinel
        follow = ""
        if sent is not None and len(sent.keys):
            follow = (f"; {int((sent.nonfinite > 0).sum())} of {len(sent.keys)} gradients "
                      f"follow from it")
        text = (f"the forward of step {frame.step}: the loss is not finite (this step read the "
                f"loss and the gradients only{follow}); the steps read after it, with every "
                f"role, name the module")
        return ("", "loss", nan, inf, numel, text, {"phase": "forward", "sampled": False})

    @staticmethod
    def _from_sentinel(frame, i):
        sent = frame.sentinel
        module, role = sent.keys[i]
        nan = float(sent.nan[i])
        inf = float(sent.nonfinite[i] - sent.nan[i])
        order = "in backward order" if sent.ordered else "in parameter order"
        before = (f"the {i} gradient(s) ready before it were finite, the last "
                  f"{_where(sent.keys[i - 1][0])} {sent.keys[i - 1][1]}" if i
                  else "it is the first gradient ready in backward")
        text = (f"{_where(module)} {role}, the first parameter gradient {order} that holds them "
                f"({before}; the loss was finite)")
        extra = {"phase": "backward", "source": "sentinel", "backward_index": i,
                 "finite_before": [f"{m}:{r}" for m, r in sent.keys[max(0, i - 5):i]]}
        return module, role, nan, inf, float(sent.numel[i]), text, extra

    @staticmethod
    def _spread(frame, bad, found) -> str:
        module, role = found[0], found[1]
        later = [(m, r) for m, r in (frame.keys[i] for i in bad) if (m, r) != (module, role)]
        sent = frame.sentinel
        if sent is not None:
            seen = set(later) | {(module, role)}
            later += [k for k, n in zip(sent.keys, sent.nonfinite) if n > 0 and k not in seen]
        if not later:
            return ""
        names = [f"{_where(m)}:{r}" for m, r in later[:5]]
        return (f"; then in {len(later)} later tensor(s): {', '.join(names)}"
                + (", ..." if len(later) > 5 else ""))

    @staticmethod
    def _origin_text(frame: StatsFrame, i: int, module: str, role: str) -> str:
        phase = frame.phases[i]
        if phase == Phase.BATCH:
            return "the batch (before the model ran)"
        if role == "input":
            return f"the input of {_where(module)} (produced outside the watched modules)"
        if phase == Phase.WEIGHT:
            return f"parameter {role} of {_where(module)} (before this step's forward)"
        if role == "loss":
            return "the loss (every watched forward output was finite)"
        return f"{_where(module)} {role} (every tensor read before it was finite)"


_PHASE_NAMES = {Phase.BATCH: "batch", Phase.WEIGHT: "weight", Phase.FORWARD: "forward",
                Phase.LOSS: "forward", Phase.BACKWARD: "backward", Phase.GRAD: "backward",
                Phase.OPTIM: "optimizer"}


def _other_rank_gradient(sent):
    """The first gradient (backward order) that another rank's sentinel found bad, from the
    every-step cross-rank reduction (SentinelFrame.row_ranks), as an _origin tuple; or None."""
    rr = sent.row_ranks
    if rr is None:
        return None
    hit = np.flatnonzero(rr[:, 1] >= 0)
    if not len(hit):
        return None
    k = int(hit[0])
    module, role = sent.keys[k]
    lo, hi = int(rr[k, 0]), int(rr[k, 1])
    who = f"rank {lo}" if lo == hi else f"ranks {lo}..{hi}"
    extra = {"phase": "backward", "other_rank": True, "source": "cross_rank_flags",
             "ranks": [lo] if lo == hi else [lo, hi], "rank_range": [lo, hi]}
    return (module, role, 0.0, 0.0, 0.0,
            f"{module or '<model>'} {role} on {who} (this rank's gradients were finite; the "
            f"sentinel's cross-rank reduction names the gradient; its counts are on that rank)",
            extra)
