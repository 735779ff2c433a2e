"""Replay's verdicts, each from a scenario built for it (tiny fp16 models on the CPU): numerics
(with a parameter gradient that overflows fp16), code outside the model factory, other package
versions, missing state or batch, non-determinism."""
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

import stabilitywatch as sw
from stabilitywatch import cli
from stabilitywatch.capture.report import replay_text

import capture_models as cm
from test_capture_trust import reseal

NAMES = {"model_factory": "capture_models:build", "step_fn": "capture_models:step_fp16"}


def _bundle(run_dir, mon):
    return run_dir / next(a.capture for a in mon.alerts if a.capture)


@pytest.fixture(scope="module")
def overflow(tmp_path_factory):
    """fc2's weights x1e5: fc2's output overflows fp16."""
    out = tmp_path_factory.mktemp("ov") / "run"
    mon, _, _ = cm.train(out)
    return _bundle(out, mon)


def _copy(bundle, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(bundle, dst)
    return dst


def test_fp16_parameter_gradient_overflow_is_named_and_explained(tmp_path):
    out = tmp_path / "run"
    mon, _, _ = cm.train_wide(out)
    # the x1e4 write is also a physics alert (a bad write) of the same step and bundle
    alert = next(a for a in mon.alerts if a.capture and a.detector == "nonfinite")
    assert (alert.module, alert.tensor, alert.stat) == ("inp", "grad", "inf")
    bundle = out / alert.capture
    rows = json.loads((bundle / "manifest.json").read_text())["stats"]
    finite = {tuple(k) for k, r in zip(rows["keys"], rows["rows"])
              if not any(isinstance(x, str) for x in r[:5]) and r[1] + r[2] + r[3] == 0}
    # the scenario: every output and output gradient is finite, a parameter gradient is not
    assert {("inp", "output"), ("out", "output"), ("inp", "grad_output")} <= finite
    assert ("inp", "grad") not in finite

    r = sw.replay(bundle, progress=False, upcast=["inp"], model_factory="capture_models:build_wide",
                  step_fn="capture_models:step_sum_fp16")
    assert r["reproduces"] is True
    assert r["first_divergent"]["module"] == "inp" and r["first_divergent"]["tensor"] == "grad"
    row = next(m for m in r["modules"] if (m["module"], m["tensor"]) == ("inp", "grad"))
    assert row["nonfinite_low"] > 0 and row["nonfinite_ref"] == 0
    # each run starts from the captured optimizer state, not from one a run before it stepped
    state = next(m for m in r["modules"] if (m["module"], m["tensor"]) == ("inp", "optim.exp_avg"))
    assert state["nonfinite_ref"] == 0 and state["nonfinite_low"] > 0
    ex = r["explanation"]
    assert ex["kind"] == "overflow" and ex["dtype"] == "float16"
    assert ex["reference_absmax"] == row["absmax_ref"] > torch.finfo(torch.float16).max
    assert set(ex["remedy"]) == {"upcast", "loss_scale"}
    assert "--upcast inp" in ex["text"] and "scaling the loss down" in ex["text"]
    assert r["verdict"]["kind"] == "numerics"
    assert r["verdict"]["where"] == {"module": "inp", "tensor": "grad"}
    # what the explanation says, checked: inp in fp32 takes the alert away
    assert r["upcast"]["anomaly_disappears"] is True
    text = replay_text(r)
    assert "first divergent module: inp (grad" in text
    assert "explanation: inp grad overflowed" in text
    # every role the monitor reads is compared, in dataflow order
    roles = [(m["module"], m["tensor"]) for m in r["modules"]]
    for k in [("inp", "weight"), ("inp", "output"), ("", "loss"), ("out", "grad_output"),
              ("inp", "grad"), ("inp", "optim.exp_avg"), ("inp", "optim.update")]:
        assert k in roles, k
    assert (roles.index(("inp", "weight")) < roles.index(("inp", "output"))
            < roles.index(("out", "output")) < roles.index(("", "loss"))
            < roles.index(("out", "grad_output")) < roles.index(("inp", "grad_output"))
            < roles.index(("inp", "grad")) < roles.index(("inp", "optim.exp_avg"))
            < roles.index(("inp", "optim.update")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp16_parameter_gradient_overflow_on_cuda(tmp_path):
    out = tmp_path / "run"
    mon, _, _ = cm.train_wide(out, device="cuda")
    # the x1e4 write is also a physics alert (a bad write) of the same step and bundle
    alert = next(a for a in mon.alerts if a.capture and a.detector == "nonfinite")
    assert (alert.module, alert.tensor) == ("inp", "grad")
    r = sw.replay(out / alert.capture, device="cuda", progress=False,
                  model_factory="capture_models:build_wide", step_fn="capture_models:step_sum_fp16")
    assert r["reproduces"] is True, r["reproduce"]["verdict"]
    assert r["verdict"]["kind"] == "numerics"
    assert r["first_divergent"]["module"] == "inp" and r["first_divergent"]["tensor"] == "grad"
    assert r["explanation"]["kind"] == "overflow"


def test_numerics(overflow, capsys):
    r = sw.replay(overflow, progress=False, **NAMES)
    v = r["verdict"]
    assert r["reproduces"] is True and v["kind"] == "numerics"
    assert v["where"] == {"module": "fc2", "tensor": "output"} and v["lacks"] == []
    assert r["explanation"]["kind"] == "overflow" and "--upcast fc2" in v["text"]
    assert "scaling the loss" not in r["explanation"]["text"]   # an output: loss scale is moot
    assert cli.main(["replay", str(overflow), "--no-progress", "--model-factory", NAMES[
        "model_factory"], "--step-fn", NAMES["step_fn"]]) == 0
    assert "verdict (numerics): numerics of this step" in capsys.readouterr().out


def test_nan_in_the_batch_is_in_the_values(tmp_path):
    def nan_input(step, model, opt, batch):
        if step == 3:
            batch["x"][0, 0] = float("nan")
    out = tmp_path / "run"
    mon, _, _ = cm.train(out, fault=1.0, before_step=nan_input)
    r = sw.replay(_bundle(out, mon), progress=False, **NAMES)
    v = r["verdict"]
    assert r["reproduces"] is True and r["first_divergent"] is None
    assert v["kind"] == "values" and "at any precision" in v["text"]
    fc1 = next(m for m in r["modules"] if (m["module"], m["tensor"]) == ("fc1", "output"))
    assert fc1["nonfinite_low"] == fc1["nonfinite_ref"] > 0     # NaN in fp64 too


def test_a_hook_in_the_loop_is_code_the_replay_lacks(tmp_path, capsys):
    out = tmp_path / "run"
    # the loop's hook runs ahead of the monitor's: fc2's own row holds the NaN
    mon, _, _ = cm.train(out, fault=1.0, before_step=cm.nan_hook_at(3, "fc2"))
    bundle = _bundle(out, mon)
    r = sw.replay(bundle, progress=False, **NAMES)
    v = r["verdict"]
    assert r["reproduces"] is False and v["kind"] == "lacks" and v["lacks"] == ["code"]
    assert v["where"] == {"module": "fc2", "tensor": "output"}
    first = v["evidence"][0]
    assert (first["module"], first["tensor"]) == ("fc2", "output")
    assert first["nonfinite"] == [1, 0] and first["large"]
    assert "the replay lacks code the run had" in v["text"] and "enters at fc2 output" in v["text"]
    assert "fc1 output included" in v["text"]     # fc2's input agrees
    argv = ["replay", str(bundle), "--no-progress", "--fail-on", "not-reproduced",
            "--model-factory", NAMES["model_factory"], "--step-fn", NAMES["step_fn"]]
    assert cli.main(argv) == 3
    text = capsys.readouterr().out
    assert "verdict (lacks): the replay lacks code" in text
    assert "fc2 output: non-finite recorded 1, replayed 0" in text


def test_a_hook_after_the_monitors_enters_at_the_next_module(tmp_path):
    out = tmp_path / "run"
    mon, _, _ = cm.train(out, fault=1.0, before_step=cm.nan_hook_at(3, "fc2", prepend=False))
    v = sw.replay(_bundle(out, mon), progress=False, **NAMES)["verdict"]
    assert v["kind"] == "lacks" and v["where"] == {"module": "ln", "tensor": "output"}
    assert "enters at ln output" in v["text"] and "fc2 output included" in v["text"]


def test_rows_the_loop_recorded_are_code_the_replay_lacks(tmp_path):
    def observe_inf(mon, step, model):
        if step == 3:
            mon.observe(torch.full((8,), float("inf")), "scratch", module="fc1")
    out = tmp_path / "run"
    mon, _, _ = cm.train(out, fault=1.0, during_step=observe_inf)
    r = sw.replay(_bundle(out, mon), progress=False, **NAMES)
    v = r["verdict"]
    assert r["reproduces"] is False and r["reproduce"]["missing"] == [["fc1", "scratch"]]
    assert v["kind"] == "lacks" and v["lacks"] == ["code"]
    assert v["where"] == {"module": "fc1", "tensor": "scratch"} and "mon.observe" in v["text"]


def test_other_package_versions(overflow, tmp_path, capsys):
    d = _copy(overflow, tmp_path)
    reseal(d, lambda m: m["versions"].update(torch="2.0.0", numpy="1.0.0"))
    # a different computation stands for what another torch computes: rows differ slightly
    r = sw.replay(d, progress=False, model_factory=NAMES["model_factory"],
                  step_fn="capture_models:step_perturbed")
    v = r["verdict"]
    assert r["reproduces"] is False and v["kind"] == "lacks" and v["lacks"] == ["versions"]
    assert {x["package"]: x["recorded"] for x in v["versions"]} == {"torch": "2.0.0",
                                                                     "numpy": "1.0.0"}
    assert v["versions"][0]["running"] == torch.__version__
    assert f"torch {torch.__version__} (recorded 2.0.0)" in v["text"]
    assert "torch: recorded 2.0.0, running" in replay_text(r)
    # the same step with the recorded code reproduces: versions noted, numerics still
    same = sw.replay(d, progress=False, **NAMES)["verdict"]
    assert same["kind"] == "numerics" and "package versions differ" in same["text"]


def test_another_device_type(overflow, tmp_path):
    d = _copy(overflow, tmp_path)
    reseal(d, lambda m: m["device"].update(type="xpu"))
    v = sw.replay(d, progress=False, device="cpu", model_factory=NAMES["model_factory"],
                  step_fn="capture_models:step_perturbed")["verdict"]
    assert v["kind"] == "lacks" and v["lacks"] == ["device"]
    assert "recorded on xpu, replayed on cpu" in v["text"]


def _empty(d, stem):
    save_file({}, str(d / f"{stem}.safetensors"))


def test_a_bundle_without_state(overflow, tmp_path, capsys):
    d = _copy(overflow, tmp_path)
    _empty(d, "model")
    _empty(d, "optimizer")
    reseal(d, lambda m: m.update(lacks=["model", "optimizer"]))
    r = sw.replay(d, progress=False, **NAMES)
    v = r["verdict"]
    assert r["reproduces"] is False and v["kind"] == "lacks"
    assert v["lacks"] == ["model state", "optimizer state"] and "written without" in v["text"]
    assert cli.main(["inspect", str(d)]) == 0
    assert "written without: model, optimizer" in capsys.readouterr().out
    assert cli.main(["replay", str(d), "--no-progress", "--fail-on", "not-reproduced",
                     "--model-factory", NAMES["model_factory"], "--step-fn",
                     NAMES["step_fn"]]) == 3


def test_a_bundle_without_batch(overflow, tmp_path, capsys):
    d = _copy(overflow, tmp_path)
    _empty(d, "batch")
    reseal(d, lambda m: m.update(lacks=["batch"], batch={"kind": "none"}))
    r = sw.replay(d, progress=False, **NAMES)
    assert r["reproduces"] is False and r["modules"] is None
    assert r["verdict"]["kind"] == "lacks" and r["verdict"]["lacks"] == ["batch"]
    assert "not re-run" in replay_text(r)
    assert cli.main(["inspect", str(d)]) == 0
    assert "batch: none (written without it)" in capsys.readouterr().out


def test_unseeded_noise_is_nondeterminism(tmp_path):
    out = tmp_path / "run"
    mon, _, _ = cm.train(out, loop_step=cm.step_noisy, step_fn="capture_models:step_noisy")
    r = sw.replay(_bundle(out, mon), progress=False, model_factory=NAMES["model_factory"],
                  step_fn="capture_models:step_noisy")
    v = r["verdict"]
    assert r["reproduces"] is False and v["kind"] == "nondeterminism"
    assert v["lacks"] == [] and v["versions"] == []
    first = v["evidence"][0]
    assert (first["module"], first["tensor"]) == ("fc1", "output") and not first["large"]
    assert "non-determinism or hardware" in v["text"] and "enters at" not in v["text"]


def test_a_malformed_lacks_field_is_refused(overflow, tmp_path, capsys):
    d = _copy(overflow, tmp_path)
    reseal(d, lambda m: m.update(lacks=["weights"]))
    assert cli.main(["replay", str(d), "--no-progress", "--model-factory",
                     NAMES["model_factory"], "--step-fn", NAMES["step_fn"]]) == 2
    err = capsys.readouterr().err
    assert "field 'lacks' names 'weights'" in err and len(err.strip().splitlines()) == 1
