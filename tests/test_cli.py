"""Command line (`stabilitywatch` / `python -m stabilitywatch`) and watch() argument errors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch import cli
from stabilitywatch.demo import FAULT_MODULE, build_model

REPO = Path(__file__).resolve().parents[1]
ALERT_KEYS = {"schema", "step", "rank", "detector", "severity", "module", "tensor", "stat",
              "value", "threshold", "message", "capture"}
# the contract's detectors, and the physics of weight updates (the contract says more may come)
DETECTORS = {"nonfinite", "overflow", "underflow", "drift", "spike", "shadow", "divergence",
             "physics"}
SEVERITIES = {"info", "warning", "critical"}


def run_cli(*args, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "stabilitywatch", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=REPO)


# -- python -m stabilitywatch -----------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--help"], ["demo", "usage"]),
    (["demo", "--help"], ["--out", "--device", "--steps", "--fault-step"]),
], ids=["top-help", "demo-help"])
def test_help(args, words):
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    for w in words:
        assert w in r.stdout
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [
    ["demo", "--steps", "0"],
    ["demo", "--fault-step", "99"],
], ids=["steps-0", "fault-step-99"])
def test_bad_demo_args_subprocess(args):
    r = run_cli(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--steps" in lines[0], r.stderr
    assert r.stdout == ""


def test_no_command_is_usage_error():
    r = run_cli()
    assert r.returncode == 2
    assert "usage" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("argv", [
    ["demo", "--steps", "0"],
    ["demo", "--steps", "-3", "--fault-step", "0"],
    ["demo", "--fault-step", "99"],
    ["demo", "--steps", "5", "--fault-step", "5"],
    ["demo", "--fault-step", "-1"],
], ids=["steps-0", "steps-negative", "fault-after-end", "fault-at-end", "fault-negative"])
def test_bad_demo_args_in_process(argv, capsys, tmp_path):
    out = tmp_path / "run"
    assert cli.main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()          # rejected before anything was written


def test_cuda_requested_without_cuda(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    assert cli.main(["demo", "--device", "cuda", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "cuda" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["demo", "--steps", "x"], ["frobnicate"], ["demo", "--device", "tpu"]],
                         ids=["steps-not-int", "unknown-command", "unknown-device"])
def test_argparse_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(argv)
    assert ei.value.code == 2
    assert "usage" in capsys.readouterr().err


# -- the demo, end to end (few steps: the full demo takes ~10 s on a CPU) ---------------------
@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    rc = cli.main(["demo", "--out", str(out), "--steps", "8", "--fault-step", "3"])
    return rc, out


def _alerts(out):
    text = (out / "alerts.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_demo_returns_0_and_writes_files(demo_run):
    rc, out = demo_run
    assert rc == 0
    for name in ("alerts.jsonl", "stats.jsonl", "run.json"):
        assert (out / name).is_file(), name
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["model_factory"] == "stabilitywatch.demo:build_model"
    assert FAULT_MODULE in manifest["modules"]


def test_demo_alerts_follow_the_contract(demo_run):
    _, out = demo_run
    alerts = _alerts(out)
    assert alerts
    module_names = {n for n, _ in build_model().named_modules()}
    for a in alerts:
        assert ALERT_KEYS <= set(a), ALERT_KEYS - set(a)
        assert isinstance(a["schema"], int) and isinstance(a["step"], int)
        assert a["rank"] == 0
        assert a["detector"] in DETECTORS
        assert a["severity"] in SEVERITIES
        assert a["module"] in module_names                    # "" (whole model) included
        assert isinstance(a["tensor"], str) and a["tensor"]
        assert isinstance(a["stat"], str) and a["stat"]
        assert isinstance(a["message"], str) and a["message"]
        for k in ("value", "threshold"):
            assert isinstance(a[k], (int, float)) or a[k] in ("nan", "inf", "-inf")
        assert a["capture"] is None or isinstance(a["capture"], str)
        assert 0 <= a["step"] < 8


def test_demo_names_the_injected_fault(demo_run):
    _, out = demo_run
    serious = [a for a in _alerts(out) if a["severity"] != "info"]
    assert serious, "no warning or critical alert"
    first = min(serious, key=lambda a: a["step"])
    assert first["step"] == 3 and first["module"] == FAULT_MODULE
    assert any(a["step"] == 3 and a["module"] == FAULT_MODULE and a["tensor"] == "output"
               and a["detector"] == "overflow" for a in serious)
    assert not [a for a in serious if a["step"] < 3]          # nothing before the fault


def test_demo_names_where_inf_first_appears(demo_run):
    # at fault_step + 3 = 6 the layer's output overflows to Inf; the critical non-finite alert
    # names the module where it first appears, not the modules it flows into
    _, out = demo_run
    nonfinite = [a for a in _alerts(out) if a["detector"] == "nonfinite"
                 and a["severity"] == "critical"]
    assert nonfinite
    first = min(nonfinite, key=lambda a: a["step"])
    assert first["step"] == 6 and first["module"] == FAULT_MODULE
    assert first["tensor"] == "output"


def test_demo_unwritable_out_is_an_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rc = cli.main(["demo", "--out", str(blocker / "run"), "--steps", "1", "--fault-step", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "cannot write to --out" in err
    assert len(err.strip().splitlines()) == 1


# -- watch() argument errors ------------------------------------------------------------------
def small():
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))


def _no_hooks(model):
    return all(not m._forward_hooks for m in model.modules()) and \
        all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


@pytest.mark.parametrize("model, words", [
    ("model", ["model", "Module", "str"]),
    (None, ["model", "Module", "NoneType"]),
    (lambda x: x, ["model", "Module", "function"]),
    (nn.Linear(2, 2).weight, ["model", "Module", "Parameter"]),
], ids=["str", "none", "function", "parameter"])
def test_watch_model_not_a_module(model, words, tmp_path):
    with pytest.raises(TypeError) as ei:
        sw.watch(model, run_dir=tmp_path / "run")
    for w in words:
        assert w in str(ei.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("make_opt, word", [
    (lambda m: "adam", "str"),
    (lambda m: m.parameters(), "generator"),
    (lambda m: list(m.parameters()), "list"),
    (lambda m: torch.optim.Adam, "type"),
], ids=["str", "parameters-generator", "parameter-list", "optimizer-class"])
def test_watch_optimizer_wrong_type(make_opt, word, tmp_path):
    m = small()
    with pytest.raises(TypeError) as ei:
        sw.watch(m, make_opt(m), run_dir=tmp_path / "run")
    msg = str(ei.value)
    assert "optimizer" in msg and "Optimizer" in msg and word in msg
    assert _no_hooks(m)


@pytest.mark.parametrize("config, word", [
    ({"every": 1}, "dict"),
    ("fp8", "str"),
    (sw.Config, "type"),
], ids=["dict", "preset-name", "class-not-instance"])
def test_watch_config_wrong_type(config, word, tmp_path):
    m = small()
    with pytest.raises(TypeError) as ei:
        sw.watch(m, config=config, run_dir=tmp_path / "run")
    msg = str(ei.value)
    assert "config" in msg and "Config" in msg and word in msg
    assert _no_hooks(m)


@pytest.mark.parametrize("kw, name", [
    ({"model_factory": "pkg.mod.build_model"}, "model_factory"),
    ({"model_factory": build_model}, "model_factory"),
    ({"model_factory": 3}, "model_factory"),
    ({"step_fn": "train_step"}, "step_fn"),
    ({"step_fn": ""}, "step_fn"),
], ids=["factory-no-colon", "factory-callable", "factory-int", "step_fn-no-colon",
        "step_fn-empty"])
def test_watch_import_path_errors(kw, name, tmp_path):
    m = small()
    with pytest.raises(ValueError) as ei:
        sw.watch(m, run_dir=tmp_path / "run", **kw)
    assert name in str(ei.value) and ":" in str(ei.value)
    assert _no_hooks(m)
    assert not (tmp_path / "run").exists()


def test_watch_unknown_module_glob(tmp_path):
    m = small()
    with pytest.raises(ValueError, match=r"blocks\.\*\.fc1"):
        sw.watch(m, config=sw.Config(modules=["blocks.*.fc1"]), run_dir=tmp_path / "run")
    assert _no_hooks(m)
    assert not (tmp_path / "run").exists()           # nothing written, no sink started


def test_watch_valid_arguments_attach_and_detach(tmp_path):
    # the positive control for the error tests above
    m = small()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    mon = sw.watch(m, opt, config=sw.Config(sinks=(), modules=["0", "2"]),
                   run_dir=tmp_path / "run", model_factory="pkg.mod:build",
                   step_fn="pkg.mod:step")
    try:
        assert [n for n, _ in mon.modules] == ["0", "2"]
        assert not _no_hooks(m)
    finally:
        mon.close()
    assert _no_hooks(m)
    mon.close()                                       # idempotent


# -- --version --------------------------------------------------------------------------------
def test_version_subprocess():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"stabilitywatch {sw.__version__}", r
    assert sw.__version__[0].isdigit()


def test_version_in_process(capsys):
    # cli.main is what the console script calls
    with pytest.raises(SystemExit) as ei:
        cli.main(["--version"])
    assert ei.value.code == 0
    assert capsys.readouterr().out.strip() == f"stabilitywatch {sw.__version__}"
