"""The zoo: each scenario's instability is named by the root of the first loud incident (warning or
critical): the right detector, in the right step window, with the right module and role, and no
other incident root is loud.
`python tests/zoo/table.py` prints the README table (fault step, first alert, lead time)."""
import fnmatch
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import scenarios  # noqa: E402

FAULTS = ["fp16_overflow", "nan_gradient", "e4m3_outlier_growth", "e5m2_grad_underflow",
          "lr_spike", "shadow_bf16_accumulation", "attention_logit_growth"]


def key(a):
    return (a.detector, a.module, a.tensor)


def describe(alerts):
    return "\n".join(a.line()[:200] for a in alerts)


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory):
    """Each fault scenario run once for the module: they are seeded, and the tests only read
    the Run (several tests look at the same scenario)."""
    runs = {}

    def get(name):
        if name not in runs:
            runs[name] = getattr(scenarios, name)(tmp_path_factory.mktemp(name))
        return runs[name]
    return get


@pytest.mark.parametrize("name", FAULTS)
def test_fault_is_named_first_and_alone(name, zoo_run):
    run = zoo_run(name)
    loud = run.loud
    assert loud, f"{name}: no warning or critical alert\n{describe(run.alerts)}"
    first = loud[0]
    assert all(fnmatch.fnmatchcase(x, p) for x, p in zip(key(first), run.expect)), \
        f"{name}: first loud incident\n{describe(loud)}"
    lo, hi = run.window
    assert lo <= first.step <= hi, f"{name}: first loud alert at {first.step}, not in {run.window}"
    assert all(a.step >= run.fault_step for a in loud), describe(loud)
    others = [a for a in loud if not any(all(fnmatch.fnmatchcase(x, p) for x, p in zip(key(a), k))
                                         for k in run.allowed)]
    assert not others, f"{name}: other loud incidents\n{describe(others)}"
    # one incident per step: its root first, then its consequences
    for a in loud:
        mine = [b for b in run.alerts if b.incident == a.incident]
        assert mine[0] is a and not any(b.root for b in mine[1:])


def test_e4m3_forecast_comes_before_saturation(zoo_run):
    run = zoo_run("e4m3_outlier_growth")
    first = run.loud[0]
    assert first.stat == "e4m3_steps_to_overflow" and run.event_step is not None
    assert first.step < run.event_step                 # warned before the first overflow
    # the forecast's predicted step lands near the real one (linear in log2 amax)
    assert abs(first.extra["overflow_step"] - run.event_step) <= 5


def test_lr_spike_update_norm_before_loss(zoo_run):
    # Adam's update norm jumps with the learning rate, before the loss does; the global gradient
    # norm follows (its x8 threshold keeps early-training jumps of real models quiet)
    run = zoo_run("lr_spike")
    loud = [a for a in run.alerts if a.severity.value != "info"]
    assert loud and run.event_step is not None and loud[0].step < run.event_step
    assert loud[0].root and (loud[0].tensor, loud[0].stat) == ("optim.update", "update_ratio")
    assert any(a.tensor == "grad_norm" for a in loud)


def test_attention_logits_before_divergence(zoo_run):
    run = zoo_run("attention_logit_growth")
    assert run.event_step is not None and run.loud[0].step < run.event_step


def test_shadow_names_only_the_accumulating_module(zoo_run):
    run = zoo_run("shadow_bf16_accumulation")
    assert {a.module for a in run.alerts if a.detector == "shadow"} == {"pool"}


@pytest.mark.slow
def test_clean_run_has_no_warning(tmp_path):
    run = scenarios.clean_run(tmp_path)
    assert len(run.losses) >= 500
    assert [a for a in run.alerts if a.severity.value != "info"] == [], describe(run.loud)
    assert len(run.alerts) <= len(run.losses) // 100, describe(run.alerts)
    assert run.losses[-1] < run.losses[0] / 2     # it did learn
    # the run exercised every detector's inputs: shadows, logits, forecasts
    import json
    tensors = {json.loads(line)["tensor"] for line in open(tmp_path / "stats.jsonl")}
    assert {"shadow", "attn_logits", "logz", "grad_norm", "loss"} <= tensors
