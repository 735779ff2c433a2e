"""The drift detector (change points on arrays) gives exactly the alerts of the per-series
implementation it replaced (tests/drift_reference.py): same steps, modules, values, messages."""
import math
import os
import sys

import numpy as np
import pytest

import stabilitywatch as sw
from stabilitywatch.detectors import DriftDetector
from stabilitywatch.stats.buffer import Phase, StatsFrame
from stabilitywatch.stats.layout import Stat, init_row

sys.path.insert(0, os.path.dirname(__file__))
from drift_reference import DriftDetector as ReferenceDrift  # noqa: E402


def row(absmax: float, rms: float) -> np.ndarray:
    r = init_row()
    n = 1000.0
    r[Stat.NUMEL] = n
    r[Stat.MIN], r[Stat.MAX], r[Stat.ABSMAX] = -absmax, absmax, absmax
    r[Stat.SUMSQ] = rms * rms * n
    r[Stat.ABSMIN_NZ] = 1e-3
    return r


def frames(seed: int, steps: int = 90):
    rng = np.random.default_rng(seed)
    names = [(f"m{k}", role) for k in range(12)
             for role in ("output", "grad_output", "weight", "optim.exp_avg", "loss")]
    level = rng.normal(0, 3, len(names))
    out = []
    for step in range(steps):
        keys, rows = [], []
        for j, key in enumerate(names):
            if j % 7 == 3 and step < 30:      # series that appear late
                continue
            if rng.random() < 0.05:           # series missing from some frames
                continue
            if rng.random() < 0.02:
                level[j] += rng.choice([-6, 6])   # jumps
            level[j] += 0.05 * rng.normal()       # drift
            a = 2.0 ** (level[j] + 0.2 * rng.normal())
            if rng.random() < 0.03:
                a = rng.choice([0.0, math.inf, math.nan])   # not judged by drift
            keys.append(key)
            rows.append(row(a, a / 3))
        out.append(StatsFrame(step=step, keys=keys, rows=np.stack(rows),
                              scales=[1.0] * len(keys), phases=[Phase.FORWARD] * len(keys)))
    return out


def describe(alerts):
    # "bits" and "change_point" mark change points for the incidents step (stabilitywatch/incidents)
    return [(a.step, a.module, a.tensor, a.stat, a.severity, a.value, a.message,
             {k: v for k, v in a.extra.items() if k not in ("bits", "change_point")})
            for a in alerts]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cfg", [dict(), dict(formats={"output": "e4m3"},
                                              drift={"window": 12, "min_history": 4, "z": 4.0})],
                         ids=["default", "short-window"])
def test_same_alerts_as_the_per_series_implementation(seed, cfg):
    config = sw.Config(**cfg)
    new, ref = DriftDetector(config), ReferenceDrift(config)
    got, want = [], []
    for f in frames(seed):
        got += new.check(f)
        want += ref.check(f)
    assert want, "the scenario must raise drift alerts to compare"
    assert describe(got) == describe(want)
