"""The cost budget (stabilitywatch/pacing.py): the run's own step times stretch the cadences."""
import json

import pytest
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.pacing import MAX_FACTOR, Pacer


class FakeClock:
    """A host clock the test moves by hand: marks are times, every mark is ready."""

    def __init__(self):
        self.now = 0.0

    def mark(self):
        return self.now

    def ready(self, m):
        return True

    def seconds(self, a, b):
        return b - a

    def free(self, m):
        pass


def drive(pacer, steps, plain, extra, sentinel=0.0, every=10, after=0.0):
    """Run `steps` steps through the pacer: a plain step takes `plain` seconds, a sampled one
    `extra` more, the step after it `after` more; the sentinel `sentinel` of each step."""
    clock = pacer._clock = FakeClock()
    sampled_at = []
    prev_sampled = False
    for step in range(steps):
        pacer.begin(step)
        stride = every * pacer.factor
        sampled = step < 10 or step % stride == 0
        pacer.sampled(sampled)
        if sampled:
            sampled_at.append(step)
        pacer.sentinel_start()
        clock.now += sentinel
        pacer.sentinel_stop()
        clock.now += plain - sentinel + (extra if sampled else 0.0)
        clock.now += after if prev_sampled and not sampled else 0.0
        prev_sampled = sampled
    return sampled_at


@pytest.mark.parametrize("extra, sentinel, after, stride", [
    (0.003, 0.0, 0.0, 30),        # 3 ms over a 10 ms step: 0.3 step per sample at 1 %: 30
    (0.0015, 0.00005, 0.0, 30),   # the sentinel takes half of the budget: twice as sparse
    (0.002, 0.0, 0.001, 30),      # the step after a sampled one (its rows read) counts too
    (0.0001, 0.0, 0.0, 10),       # cheap sampled steps: `every` as given
    (1.0, 0.0, 0.0, 10 * MAX_FACTOR),   # never sparser than MAX_FACTOR x every
    (0.0015, 0.005, 0.0, 30),     # a sentinel over the budget: sampling keeps half of it
])
def test_the_factor_spreads_the_measured_cost_within_the_budget(extra, sentinel, after, stride):
    p = Pacer(0.01, 10, None)
    sampled = drive(p, 400, 0.010, extra, sentinel, after=after)
    assert p.factor * 10 == stride
    late = [s for s in sampled if s >= 200]
    assert late and all(s % stride == 0 for s in late)
    assert late[1:] == list(range(late[0], 400, stride))[1:]
    if stride != 10:
        note = p.changes[-1]
        assert note["every"] == stride and note["step_ms"] == pytest.approx(10.0)
        assert note["sampled_extra_ms"] == pytest.approx((extra + after) * 1e3)


def test_a_compile_on_one_step_does_not_move_the_cadence():
    p = Pacer(0.01, 10, None)
    clock = p._clock = FakeClock()
    for step in range(120):
        p.begin(step)
        sampled = step < 10 or step % (10 * p.factor) == 0
        p.sampled(sampled)
        # the first unsampled step compiles its graph: 30 s once
        clock.now += 0.010 + (30.0 if step == 10 else 0.0) + (0.0002 if sampled else 0.0)
    assert p.factor == 1 and p.changes == []


def test_off_for_every_1_budget_0_and_multi_rank_runs():
    assert not Pacer(0.01, 1, None).on
    assert not Pacer(0.0, 10, None).on
    assert not Pacer(0.01, 10, None, world_size=2).on
    p = Pacer(0.0, 10, None)
    drive(p, 200, 0.010, 1.0)
    assert p.factor == 1


def test_a_failing_clock_switches_pacing_off_with_one_message(caplog):
    p = Pacer(0.01, 10, None)

    class Broken(FakeClock):
        def mark(self):
            raise RuntimeError("no clock")

    p._clock = Broken()
    with caplog.at_level("WARNING", logger="stabilitywatch"):
        p.begin(0)
        p.begin(1)
    assert not p.on and p.factor == 1
    assert sum("timing the steps failed" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("bad", [-0.1, 1.5, "1%", float("nan"), True])
def test_a_bad_budget_is_refused_where_it_enters(bad):
    with pytest.raises(ValueError, match="cost_budget"):
        sw.Config(cost_budget=bad)


class Costly(nn.Module):
    """Many small layers: on the CPU a sampled step (every tensor's row) costs many plain
    steps."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])

    def forward(self, x):
        return self.layers(x)


def expected_sampled(steps, cadence, every=10, warmup=10):
    """The steps a run samples outside escalation windows, from the cadence changes its
    run.json lists (each applies from its own step on)."""
    out, stride, changes = set(), every, list(cadence)
    for s in range(steps):
        while changes and changes[0]["step"] <= s:
            stride = changes.pop(0)["every"]
        if s < warmup or s % stride == 0:
            out.add(s)
    return out


def run(tmp_path, config, steps=90, nan_at=None):
    torch.manual_seed(0)
    model = Costly()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, 64)
    with sw.watch(model, opt, config=config, run_dir=tmp_path) as mon:
        for step in range(steps):
            with mon.step(step):
                loss = model(x).square().mean()
                loss.backward()
                if step == nan_at:
                    model.layers[5].weight.grad[0, 0] = float("nan")
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
    rows = [json.loads(line) for line in open(mon.run_dir / "stats.jsonl")]
    sampled = sorted({r["step"] for r in rows if r["tensor"] == "output"})
    return mon, sampled, json.loads((mon.run_dir / "run.json").read_text())


def test_the_default_stretches_a_costly_cadence_on_a_real_run(tmp_path):
    mon, sampled, info = run(tmp_path / "a", sw.Config())
    assert info["cadence"], "the CPU's sampled steps cost many steps: the cadence widens, 4x at most"
    first = info["cadence"][0]
    assert first["every"] > 10 and first["every"] % 10 == 0
    assert first["sampled_extra_ms"] > 0.01 * first["step_ms"] * 10
    assert set(sampled) == expected_sampled(90, info["cadence"])
    assert sampled[:11] == list(range(11))   # the warm-up and step 10 as configured
    # the cadences as given
    _, fixed, info = run(tmp_path / "b", sw.Config(cost_budget=0))
    assert fixed == list(range(10)) + list(range(10, 90, 10)) and info["cadence"] == []
    _, every, _ = run(tmp_path / "c", sw.Config(every=1), steps=30)
    assert every == list(range(30))


def test_a_fault_on_a_stretched_cadence_is_still_caught_and_escalated(tmp_path):
    mon, sampled, info = run(tmp_path, sw.Config(), steps=120, nan_at=70)
    assert info["cadence"] and info["cadence"][0]["step"] < 70
    crit = [a for a in mon.alerts if a.severity.value == "critical"]
    assert crit and crit[0].step == 70 and crit[0].detector == "nonfinite"
    assert crit[0].module == "layers.5" and crit[0].tensor == "grad"
    # the trip opens a window of full sampling (a step late: the frame is read after the step)
    window = [s for s in sampled if 70 < s < 110]
    assert window[0] <= 73 and window[:20] == list(range(window[0], window[0] + 20))
