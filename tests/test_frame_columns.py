"""The detectors and records work on a frame's columns (numpy) with per-row state in arrays; they
give exactly the alerts and records of the row-by-row implementations in tests/frame_reference/
(same steps, modules, values, messages, order), and the scalar derivation of a small frame gives
the same numbers as the column one."""
import json
import math
import os
import sys
import time

import numpy as np
import pytest
import torch

import stabilitywatch as sw
from stabilitywatch.detectors import (NonFiniteDetector, PhysicsDetector, RangeDetector,
                                      ShadowDetector, SpikeDetector, UpdateDetector)
from stabilitywatch.detectors.series import Rings, Window
from stabilitywatch.formats import ROW_FORMATS
from stabilitywatch.records import FrameRecords
from stabilitywatch.stats.buffer import Phase, StatsFrame
from stabilitywatch.stats.derive import NAMES, derive_table
from stabilitywatch.stats.frame import PerRowSet
from stabilitywatch.stats.layout import FMT_BASE, N_STATS, Stat, init_row
from stabilitywatch.stats.sentinel import SentinelFrame

sys.path.insert(0, os.path.dirname(__file__))
from frame_reference import (nonfinite, physics, range as range_, records,  # noqa: E402
                             shadow, spike, update)

MODS = [f"m{k}" for k in range(6)]
ROLES = ["output", "grad_output", "weight", "bias", "grad", "grad.bias", "optim.exp_avg",
         "optim.update", "optim.update.bias", "attn_logits", "logz", "shadow.error",
         "shadow.output", "shadow.ulp", "shadow.live.1", "shadow.error.1", "shadow.output.1"]


def _row(rng, a, bad):
    r = init_row()
    n = 1000.0
    r[Stat.NUMEL] = n
    r[Stat.MIN], r[Stat.MAX], r[Stat.ABSMAX] = -a * rng.random(), a, a
    r[Stat.SUMSQ] = (a / 3) ** 2 * n
    r[Stat.SUM] = a * rng.normal() * n / 10
    r[Stat.ABSMIN_NZ] = a * 1e-4
    for fmt in ROW_FORMATS:
        b = FMT_BASE[fmt]
        if rng.random() < 0.1:
            r[b] = float(rng.integers(0, 30))
        if rng.random() < 0.1:
            r[b + 1] = float(rng.integers(0, 300))
    if bad:
        r[Stat.NAN], r[Stat.POSINF] = float(rng.integers(0, 3)), float(rng.integers(1, 3))
    return r


def _frames(seed, steps=45):
    """Sampled frames (2 in 3; some rows missing, jumps, drifts, zeros, NaN/Inf) and loss-only
    ones, each with a sentinel."""
    rng = np.random.default_rng(seed)
    names = [(m, r) for m in MODS for r in ROLES] + [("", "loss"), ("", "input")]
    level = rng.normal(0, 3, len(names))
    loss = 5.0
    grads = [(m, r) for m in reversed(MODS) for r in ("grad", "grad.bias")]
    out = []
    for step in range(steps):
        keys, rows = [], []
        for j, key in enumerate(names):
            if step % 3 == 1 and key != ("", "loss"):
                continue
            if rng.random() < 0.05 and key != ("", "loss"):
                continue
            if rng.random() < 0.03:
                level[j] += rng.choice([-6, 6])
            level[j] += 0.05 * rng.normal()
            a = 2.0 ** (level[j] + 0.2 * rng.normal())
            if key == ("", "loss"):
                loss = loss * 0.99 + (rng.random() < 0.05) * rng.random() * 5
                a = loss
            if rng.random() < 0.02:
                a = float(rng.choice([0.0, math.inf, math.nan]))
            if key[1].startswith("shadow"):
                a = 1.0 + 3 * rng.random()
            keys.append(key)
            rows.append(_row(rng, a, rng.random() < 0.01))
        n = len(grads)
        nf = np.zeros(n)
        if rng.random() < 0.05:
            nf[rng.integers(0, n)] = 2
        sent = SentinelFrame(step=step, keys=grads, nonfinite=nf, absmax=rng.random(n),
                             sumsq=rng.random(n), present=np.ones(n, bool), nan=nf / 2,
                             numel=np.full(n, 100.0))
        phases = [Phase.LOSS if r == "loss" else Phase.GRAD if r.startswith("grad")
                  else Phase.FORWARD for _, r in keys]
        out.append(StatsFrame(step=step, keys=keys, rows=np.stack(rows), phases=phases,
                              scales=[2.0 if r == "output" else 1.0 for _, r in keys],
                              sentinel=sent))
    return out


def _pairs(cfg):
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in MODS])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mods = [(m, model[k]) for k, m in enumerate(MODS)]
    return [(NonFiniteDetector(5), nonfinite.NonFiniteDetector(5)),
            (RangeDetector(cfg), range_.RangeDetector(cfg)),
            (SpikeDetector(cfg), spike.SpikeDetector(cfg)),
            (UpdateDetector(cfg), update.UpdateDetector(cfg)),
            (PhysicsDetector(cfg, opt, mods), physics.PhysicsDetector(cfg, opt, mods)),
            (ShadowDetector(cfg), shadow.ShadowDetector(cfg))]


def _plain(recs):
    return json.dumps([{k: (dict(v) if k == "stats" else v) for k, v in r.items()} for r in recs],
                      default=str)


CONFIGS = {
    "default": sw.Config(),
    "formats, sensitive": sw.Config(
        formats={"output": "e4m3", "grad*": "e5m2", "weight": "fp16"},
        spike={"z": 2.0, "layer_grad_bits": 0.3, "grad_bits": 0.3, "min_history": 3,
               "window": 7},
        update={"spike_bits": 0.2, "min_history": 3, "window": 9},
        shadow={"rel_warn": 0.3, "rel_critical": 3.0}),
}


@pytest.mark.parametrize("name", list(CONFIGS), ids=list(CONFIGS))
def test_alerts_and_records_match_the_row_by_row_reference(name):
    cfg = CONFIGS[name]
    t0 = time.monotonic()
    pairs = _pairs(cfg)
    fast_records = FrameRecords()
    counts = {}
    for fast_frame, ref_frame in zip(_frames(1), _frames(1)):   # frames carry per-frame memos
        for fast, ref in pairs:
            got = [a.to_dict() for a in fast.check(fast_frame)]
            want = [a.to_dict() for a in ref.check(ref_frame)]
            assert got == want, (name, type(fast).__name__, fast_frame.step)
            counts[type(fast).__name__] = counts.get(type(fast).__name__, 0) + len(got)
        base = {"step": fast_frame.step}
        assert _plain(fast_records(fast_frame, base)) == _plain(records.frame_records(ref_frame,
                                                                                      base))
        assert time.monotonic() - t0 < 60
    # the streams exercise every detector
    assert all(counts[k] > 0 for k in ("NonFiniteDetector", "SpikeDetector",
                                       "PhysicsDetector", "ShadowDetector")), counts
    if name != "default":
        assert counts["RangeDetector"] > 0 and counts["UpdateDetector"] > 0, counts


@pytest.mark.parametrize("size", [1, 2, 3, 7, 50], ids=lambda s: f"window{s}")
def test_rings_give_window_values(size):
    rng = np.random.default_rng(size)
    rings, windows = Rings(size), {}
    rows = rings.rows(list(range(30)))
    for _ in range(3 * size + 10):
        sel = np.flatnonzero(rng.random(30) < 0.7)
        x = rng.normal(size=len(sel)) * rng.choice([1e-3, 1.0, 1e3])
        if not len(sel):
            continue
        med, sigma = rings.noise(rows[sel])
        recent = rings.recent(rows[sel], 5)
        for j, s in enumerate(sel.tolist()):
            w = windows.setdefault(s, Window(size))
            if len(w):
                assert (med[j], sigma[j], recent[j]) == (*w.noise(), w.recent(5))
            w.push(float(x[j]))
        rings.push(rows[sel], x)


def _odd_rows(rng, n):
    out = []
    for t in range(n):
        r = init_row() if t % 4 == 0 else rng.normal(size=N_STATS) * 10.0 ** rng.integers(-30, 30)
        r = np.asarray(r, dtype=np.float64).copy()
        if t % 4:
            r[Stat.NUMEL] = float(rng.integers(0, 5))
            r[Stat.NAN] = float(rng.integers(0, 2))
            for k in (Stat.ABSMAX, Stat.ABSMIN_NZ, Stat.SUMSQ, Stat.SHIFT):
                if rng.random() < 0.15:
                    r[k] = rng.choice([0.0, -0.0, np.inf, np.nan, -1.0])
        out.append(r)
    return out


def test_small_frames_derive_the_same_numbers_as_columns():
    rng = np.random.default_rng(0)
    rows = _odd_rows(rng, 400)
    scales = [float(rng.choice([1.0, 0.0, np.nan, 1e-40, 3.0, np.inf, -2.0])) for _ in rows]
    many, arrays, _ = derive_table(np.stack(rows), scales)
    assert arrays is not None
    for i, (r, s) in enumerate(zip(rows, scales)):
        one, none, _ = derive_table(r[None, :], [s])
        assert none is None   # the scalar path
        assert list(one) == list(NAMES)
        for k in NAMES:
            assert repr(one[k][0]) == repr(many[k][i]), (k, i, one[k][0], many[k][i])


def test_row_set_plans_are_made_once_per_set_of_keys():
    built = []
    plans = PerRowSet(lambda keys: built.append(keys) or len(built), size=2)
    a = [("m", "output"), ("m", "grad")]
    def frame(keys):
        return StatsFrame(step=0, keys=list(keys), rows=np.zeros((len(keys), N_STATS)),
                          scales=[1.0] * len(keys), phases=[0] * len(keys))

    assert plans(frame(a)) == plans(frame(a)) == 1
    assert plans(frame(a[:1])) == 2 and plans(frame(a)) == 1
    assert plans(frame(a[1:])) == 3 and len(built) == 3   # a third set: the oldest goes
    assert plans(frame(a)) == 4
