"""The zoo on HF transformers GPT-2 and Llama (tests/zoo/hf_scenarios.py), default Config():
the first loud incident comes at the expected step, with the expected severity, root module and
role, as one incident (its root first in alerts.jsonl); clean runs of 1,000 steps raise no
warning and at most one alert per 100 steps. `python tests/zoo/table_hf.py` prints the README
table."""
import fnmatch
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import hf_scenarios as H  # noqa: E402

GPT2 = [n for n in H.FAULTS if n != "fp16_growth"]    # fp16_growth: its own test below
LLAMA = ["weight_jump", "backward_nan", "forward_inf", "bad_batch"]
# faults on a sampled step (20) and on an unsampled one (17: the sentinel, or the next read)
UNSAMPLED = ["weight_jump", "bit_flip", "backward_nan", "forward_inf", "lr_blowup", "bad_batch"]
CASES = ([("gpt2", n, 20) for n in GPT2] + [("llama", n, 20) for n in LLAMA]
         + [("gpt2", n, 17) for n in UNSAMPLED])


def describe(run):
    return "\n".join(a.line()[:220] for a in run.roots[:8])


def check(run, run_dir):
    got = run.got()
    assert got is not None, f"{run.name}: no loud incident\n{describe(run)}"
    step, sev, module, role = run.expect
    lo, hi = step if isinstance(step, tuple) else (step, step)
    assert lo <= got[0] <= hi and got[1] == sev and fnmatch.fnmatchcase(got[2], module) \
        and fnmatch.fnmatchcase(got[3], role), \
        f"{run.name} ({run.arch}): expected {run.expect}, got {got}\n{describe(run)}"
    # nothing loud before the fault; the root is written first, its incident's alerts follow
    assert all(a.step >= run.fault_step for a in run.loud_roots)
    lines = [json.loads(x) for x in open(run_dir / "alerts.jsonl")]
    first = next(x for x in lines if x["incident"] == run.first.incident)
    assert first["root"] and (first["module"], first["tensor"]) == got[2:]
    ids = [x["incident"] for x in lines]
    assert ids == sorted(ids, key=ids.index)          # one incident's lines are contiguous
    assert sum(x["root"] for x in lines) == len(set(ids))


@pytest.mark.parametrize("arch,name,fault", CASES, ids=[f"{a}-{n}-{f}" for a, n, f in CASES])
def test_first_incident(arch, name, fault, tmp_path):
    run = H.FAULTS[name](tmp_path, arch=arch, fault=fault, steps=run_steps(name, fault))
    check(run, tmp_path)


def run_steps(name, fault):
    """Steps to run: until the first read that must show the fault."""
    if name == "attention_logit_growth":
        return fault + 11
    if not H.sampled(fault):
        return H.first_read(fault) + 1
    return fault + {"lr_blowup": 3, "bad_batch": 1}.get(name, 2)


def test_fp16_forecast_comes_before_the_overflow(tmp_path):
    run = H.fp16_growth(tmp_path)
    check(run, tmp_path)
    over = [a for a in run.alerts if a.detector == "overflow"]
    assert over and run.first.stat == "fp16_steps_to_overflow"
    assert run.first.step < over[0].step


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_clean_run_is_quiet(arch, tmp_path):
    run = H.clean(tmp_path, arch=arch)
    assert run.steps == 1000
    assert run.losses[-1] < 0.6 * run.losses[0]       # it learnt
    loud = [a for a in run.alerts if a.severity.value != "info"]
    assert loud == [], describe(run)
    assert len(run.alerts) <= run.steps // 100, describe(run)
    # change points are statistics there
    recs = [json.loads(x) for x in open(tmp_path / "stats.jsonl")]
    assert any(r["tensor"] == "grad_norm" for r in recs)
