"""End to end: the demo's injected fault, seen through every sink a user looks at."""
import json
import os
import sys

import pytest

from stabilitywatch import Config
from stabilitywatch.demo import FAULT_MODULE, demo_config, run_demo

sys.path.insert(0, os.path.dirname(__file__))
import wandb_reader  # noqa: E402


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    os.environ["WANDB_MODE"] = "offline"
    out = tmp_path_factory.mktemp("demo")
    cfg = demo_config().replace(sinks=("jsonl", "console", "wandb", "tensorboard"))
    return run_demo(out, device="cpu", steps=12, fault_step=6, config=cfg)


def test_demo_catches_fault_at_step_and_module(demo):
    # the fault (the layer's weights x2e3) is a bad write: the root of the step's incident,
    # the E4M3 overflow of its output a consequence
    first = [a for a in demo.alerts if a.severity.value != "info"][0]
    assert (first.step, first.module, first.tensor, first.detector, first.root) == \
        (6, FAULT_MODULE, "weight", "physics", True)
    assert (6, FAULT_MODULE, "output", "overflow", first.incident) in \
        [(a.step, a.module, a.tensor, a.detector, a.incident) for a in demo.alerts]
    crit = [a for a in demo.alerts if a.detector == "nonfinite"]
    assert [(a.step, a.module, a.tensor) for a in crit] == [(9, FAULT_MODULE, "output")]
    lines = [json.loads(x) for x in open(demo.run_dir / "alerts.jsonl")]
    assert [(d["step"], d["module"], d["detector"]) for d in lines] == \
        [(a.step, a.module, a.detector) for a in demo.alerts]


def _wandb_run(demo):
    files = wandb_reader.find_run_files(str(demo.run_dir))
    assert len(files) == 1
    return wandb_reader.read_finished_run(files[0]), os.path.dirname(files[0])


def test_demo_wandb_run_holds_metrics_alerts_histograms_and_config(demo):
    pytest.importorskip("wandb")  # `make test` installs it; a bare GPU image may lack it
    recs, run_files = _wandb_run(demo)
    rows = wandb_reader.history_rows(recs)
    key = f"sw.output.absmax/{FAULT_MODULE}"
    by_step = {r["sw/step"]: r[key] for r in rows if key in r}
    assert set(range(12)) <= set(by_step)
    assert by_step[6] > 448 > by_step[5]          # the saturation is visible on the dashboard
    assert by_step[9] == float("inf") or by_step[9] > 1e30 or by_step[9] != by_step[9]
    hists = [r[f"sw.output.exponents/{FAULT_MODULE}"] for r in rows
             if f"sw.output.exponents/{FAULT_MODULE}" in r]
    assert len(hists) >= 9 and all(h["_type"] == "histogram" for h in hists)
    # every warning and critical alert reached wandb.alert, and every alert the table
    sent = "\n".join(a.text for a in wandb_reader.records_of(recs, "alert"))
    serious = [a for a in demo.alerts if a.severity.value != "info"]
    assert serious and all(a.line() in sent for a in serious)
    table = None
    for summ in wandb_reader.records_of(recs, "summary"):
        for item in summ.update:
            if item.key == "sw.alerts/table":
                table = json.loads(item.value_json)
    with open(os.path.join(run_files, "files", table["path"])) as f:
        data = json.load(f)["data"]
    assert [(d[0], d[2], d[4]) for d in data] == [(a.step, a.detector, a.module)
                                                  for a in demo.alerts]
    cfg = [json.loads(i.value_json) for rec in recs if rec.WhichOneof("record_type") == "run"
           for i in rec.run.config.update if i.key == "stabilitywatch"]
    assert cfg and cfg[0]["formats"] == {"output": "e4m3"} and cfg[0]["every"] == 1


def _watched(model):
    return [n for n, m in model.named_modules()
            if not list(m.children()) and list(m.parameters(recurse=False))]


def test_demo_keys_per_sampled_step_follow_the_budget(demo):
    # per watched module (each owns one weight; biases are left out): output 3 + 2 (the e4m3
    # fractions of its configured format) + a histogram, grad_output 3 + 1, and weight, grad
    # and Adam's two moments and the optimizer's update (optim.update) 3 + 1 each; then the loss
    # (mean, nonfinite) and the gradient norm
    pytest.importorskip("wandb")
    from stabilitywatch.demo import build_model
    modules = _watched(build_model())
    recs, _ = _wandb_run(demo)
    (row,) = [r for r in wandb_reader.history_rows(recs)
              if r.get("sw/step") == 0 and f"sw.output.absmax/{FAULT_MODULE}" in r]
    keys = [k for k in row if k.startswith("sw.") and not k.startswith("sw.alerts/")]
    assert len(keys) == len(modules) * (6 + 4 + 5 * 4) + 3
    sections = {k.split("/", 1)[0] for k in keys}
    assert len(sections) == 6 + 4 + 5 * 4 + 3          # one per (role, statistic)
    assert max(sum(k.startswith(s + "/") for k in keys) for s in sections) == len(modules)


def test_readme_states_gpt2_small_key_count():
    # the README's figure, from benchmarks/dashboard_keys.py: GPT-2 small's modules at width
    # 16 (the count depends on names and parameters only), ~6 s of CPU for transformers
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import dashboard_keys
    model, loss_fn = dashboard_keys.build("gpt2", tiny=True)
    n, sections = dashboard_keys.count(model, loss_fn, Config())
    watched = _watched(model)
    params = {id(p) for name in watched
              for p in model.get_submodule(name).parameters(recurse=False)}
    weights = len({id(model.get_submodule(n).weight) for n in watched})
    assert len(params) > weights           # biases exist, and are not on the dashboards
    assert n == len(watched) * 2 * 4 + weights * 5 * 4 + 3
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    assert f"{n:,} keys per sampled step" in readme


def test_demo_tensorboard_holds_metrics_histograms_alerts_config(demo):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(demo.run_dir / "tensorboard"),
                           size_guidance={"tensors": 0, "histograms": 0, "scalars": 0})
    acc.Reload()
    tag = f"sw.output.e4m3_overflow_frac/{FAULT_MODULE}"
    events = {e.step: e.value for e in acc.Scalars(tag)}
    assert events[5] == 0 and events[6] > 0.5
    assert len(acc.Histograms(f"sw.output.exponents/{FAULT_MODULE}")) >= 9
    lines = []
    for sev in ("critical", "warning", "info"):
        t = f"sw.alerts/{sev}/text_summary"
        if t in acc.Tags()["tensors"]:
            for e in acc.Tensors(t):
                lines += [ln[2:] for ln in e.tensor_proto.string_val[0].decode().splitlines()]
    assert sorted(lines) == sorted(a.line() for a in demo.alerts)
    assert "sw.config/text_summary" in acc.Tags()["tensors"]


def test_default_config_is_quiet_on_a_healthy_run(tmp_path):
    r = run_demo(tmp_path, device="cpu", steps=30, fault_step=10**6,
                 config=Config(formats={"output": "e4m3"}, sinks=("jsonl",)))
    assert [a for a in r.alerts if a.severity.value != "info"] == []
