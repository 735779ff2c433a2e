"""What the dashboards show (sinks/dashboard.py) and the Config fields that choose it."""
import pytest

import stabilitywatch as sw
from stabilitywatch.sinks.dashboard import Dashboard, run_config
from stabilitywatch.stats.derive import derive
from stabilitywatch.stats.layout import HIST_BINS, HIST_EMIN, init_row, Stat

ROW = dict(derive(init_row()))


def keys(dash, role, module="fc"):
    return dash.values({"module": module, "tensor": role, "stats": ROW})[0]


def test_default_set_per_role_follows_the_configured_formats():
    dash = Dashboard.from_config(sw.Config(formats={"output": "e4m3", "grad*": "e5m2"}))
    assert keys(dash, "output") == ["sw.output.absmax/fc", "sw.output.rms/fc",
                                    "sw.output.nonfinite/fc", "sw.output.e4m3_overflow_frac/fc",
                                    "sw.output.e4m3_underflow_frac/fc"]
    assert [k.split("/")[0] for k in keys(dash, "grad_output")][3:] == [
        "sw.grad_output.e5m2_overflow_frac", "sw.grad_output.e5m2_underflow_frac"]
    assert len(keys(dash, "weight")) == 3 and len(keys(dash, "optim.exp_avg_sq")) == 3
    assert keys(dash, "bias") == [] and keys(dash, "grad.bias") == []
    assert keys(dash, "shadow.error") == []
    assert keys(dash, "loss", "") == ["sw.loss.mean/model", "sw.loss.nonfinite/model"]


def test_more_by_name_glob_or_role_and_replacing_the_set():
    dash = Dashboard(("default", "std", "fp16_*_frac", "*bias:absmax"))
    out = keys(dash, "output")
    assert "sw.output.std/fc" in out and "sw.output.fp16_overflow_frac/fc" in out
    assert "sw.output.fp16_underflow_frac/fc" in out and "sw.output.fp16_overflow/fc" not in out
    assert keys(dash, "grad.bias") == ["sw.grad.bias.absmax/fc"]
    assert keys(Dashboard(("mean",)), "grad") == ["sw.grad.mean/fc"]
    cfg = sw.Config(sinks={"dashboard_stats": ("l2norm",)})
    assert Dashboard.from_config(cfg).entries == ("l2norm",)


def test_nonfinite_and_histogram_values():
    row = init_row()
    row[Stat.NUMEL], row[Stat.NAN], row[Stat.POSINF], row[Stat.NEGINF] = 10, 1, 2, 3
    row[Stat.HIST + 5] = 2.0
    row[Stat.HIST + 9] = 4.0
    from stabilitywatch.stats.derive import derive_many
    (stats,) = derive_many(row[None, :], [1.0])
    dash = Dashboard()
    rec = {"module": "fc", "tensor": "output", "stats": stats}
    names, vals = dash.values(rec)
    assert dict(zip(names, vals))["sw.output.nonfinite/fc"] == 6.0
    key, first, counts = dash.histogram(rec)
    assert key == "sw.output.exponents/fc" and first == HIST_EMIN + 5
    assert counts.tolist() == [2, 0, 0, 0, 4]
    assert stats.hist.shape == (HIST_BINS,) and "hist" not in dict(stats)   # not in stats.jsonl
    assert Dashboard(histograms=False).histogram(rec) is None
    assert dash.histogram({**rec, "module": "", "tensor": "loss"}) is None


def test_run_config_is_plain_json():
    import json
    cfg = run_config(sw.Config(formats={"output": "e4m3"}, select=lambda n, m: True), 3, 8)
    assert json.loads(json.dumps(cfg, allow_nan=False)) == cfg
    assert cfg["formats"] == {"output": "e4m3"} and (cfg["rank"], cfg["world_size"]) == (3, 8)
    assert cfg["versions"]["stabilitywatch"] == sw.__version__ and cfg["backend"] == "auto"


@pytest.mark.parametrize("bad,field", [
    ({"dashboard_stats": ("nosuchstat",)}, "sinks.dashboard_stats"),
    ({"dashboard_stats": ("grad:nosuch*",)}, "sinks.dashboard_stats"),
    ({"dashboard_stats": (3,)}, "sinks.dashboard_stats"),
    ({"dashboard_histograms": "yes"}, "sinks.dashboard_histograms"),
    ({"wandb_run": "mine"}, "sinks.wandb_run"),
], ids=["unknown-stat", "unknown-role-stat", "non-str", "histograms-str", "wandb_run"])
def test_dashboard_config_fields_are_checked(bad, field):
    with pytest.raises(ValueError, match=field):
        sw.Config(sinks=bad)
