"""series.theil_sen gives scipy.stats.theilslopes' slope and confidence interval (scipy is a dev
dependency only for this comparison)."""
import numpy as np
import pytest

from stabilitywatch.detectors.series import theil_sen

stats = pytest.importorskip("scipy.stats", reason="the comparison needs scipy (dev extras)")


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.6])
def test_same_as_scipy(seed, confidence):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 40))
    x = np.sort(rng.integers(0, 3 * n, n)).astype(float)        # ties in x
    y = np.round(rng.normal(0, 1, n) + 0.1 * x, int(rng.integers(0, 3)))  # ties in y
    if seed % 5 == 0:
        x = np.arange(n, dtype=float)
    want = stats.theilslopes(y, x, alpha=confidence)
    got = theil_sen(y, x, confidence)
    np.testing.assert_allclose(got, (want.slope, want.low_slope, want.high_slope), rtol=0,
                               atol=0, equal_nan=True)


def test_identical_x_gives_nan():
    assert all(np.isnan(theil_sen(np.array([1.0, 2.0]), np.array([3.0, 3.0]), 0.9)))


def test_forecast_does_not_import_scipy():
    import subprocess
    import sys
    code = ("import sys, numpy as np, stabilitywatch as sw\n"
            "from stabilitywatch.detectors import DriftDetector\n"
            "from stabilitywatch.stats.buffer import Phase, StatsFrame\n"
            "from stabilitywatch.stats.layout import Stat, init_row\n"
            "det = DriftDetector(sw.Config(formats={'output': 'e4m3'}))\n"
            "n = 0\n"
            "for i in range(30):\n"
            "    r = init_row(); a = 100.0 * 1.1 ** i\n"
            "    r[Stat.NUMEL] = 10; r[Stat.MIN], r[Stat.MAX], r[Stat.ABSMAX] = -a, a, a\n"
            "    r[Stat.SUMSQ] = a * a; r[Stat.ABSMIN_NZ] = 1.0\n"
            "    f = StatsFrame(step=i, keys=[('m', 'output')], rows=np.stack([r]),\n"
            "                   scales=[1.0], phases=[Phase.FORWARD])\n"
            "    n += sum(a.stat == 'e4m3_steps_to_overflow' for a in det.check(f))\n"
            "assert n > 0, 'no forecast'\n"
            "print('scipy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
