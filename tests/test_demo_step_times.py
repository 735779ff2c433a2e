"""The demo prints its monitored and unmonitored step times."""
import dataclasses
import re

from stabilitywatch.demo import run_demo, summary


def test_demo_reports_both_step_times(tmp_path):
    r = run_demo(tmp_path / "run", device="cpu", steps=2, fault_step=1, baseline=True)
    assert r.ms_per_step > 0 and r.ms_per_step_unmonitored > 0
    line = next(x for x in summary(r).splitlines() if x.startswith("step time:"))
    got = re.fullmatch(r"step time: ([\d.]+) ms monitored, ([\d.]+) ms unmonitored \(([\d.]+)x\)",
                       line)
    assert got, line
    mon, base, ratio = map(float, got.groups())
    assert (mon, base) == (round(r.ms_per_step, 1), round(r.ms_per_step_unmonitored, 1))
    assert abs(ratio - r.ms_per_step / r.ms_per_step_unmonitored) < 0.01
    # without the comparison run (run_demo's default) there is no such line
    assert "step time:" not in summary(dataclasses.replace(r, ms_per_step_unmonitored=None))
