"""The demo's injected fault produces captures, and replay names the faulty module (the README's
"Post-mortem" walk-through, on a shorter run: fault at step 1, Inf at step 4)."""
import json
import shlex

import pytest

import stabilitywatch as sw
from stabilitywatch import cli
from stabilitywatch.demo import FAULT_MODULE, MODEL_FACTORY, STEP_FN, replay_command


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("pm") / "run"
    assert cli.main(["demo", "--out", str(out), "--steps", "5", "--fault-step", "1"]) == 0
    return out


def test_demo_alerts_point_to_captures(demo, capsys):
    alerts = [json.loads(x) for x in (demo / "alerts.jsonl").read_text().splitlines()]
    caps = {a["step"]: a["capture"] for a in alerts if a["severity"] == "critical"}
    assert caps == {1: "captures/step00000001-rank0", 4: "captures/step00000004-rank0"}
    for c in caps.values():
        assert (demo / c / "manifest.json").is_file()


def test_replay_inf_step_names_the_fault(demo, tmp_path, capsys):
    out = tmp_path / "replay.json"
    # the command line the demo prints for this capture, as printed
    argv = shlex.split(replay_command(demo / "captures/step00000004-rank0"))
    assert argv[:2] == ["stabilitywatch", "replay"]
    rc = cli.main([*argv[1:], "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["reproduces"] is True and r["first_divergent_module"] == FAULT_MODULE
    assert f"first divergent module: {FAULT_MODULE}" in text and "reproduces bit for bit" in text
    # weights of 1e38 overflow fp32 as well: the explanation does not offer upcasting
    ex = r["explanation"]
    assert ex["kind"] == "overflow" and ex["remedy"] == [] and ex["reference_absmax"] > 3.5e38
    assert "computing it in fp32 does not remove the overflow" in text
    assert r["verdict"]["kind"] == "numerics"


def test_replay_overflow_step_names_the_fault(demo):
    r = sw.replay(demo / "captures/step00000001-rank0", progress=False,
                  model_factory=MODEL_FACTORY, step_fn=STEP_FN)
    assert r["reproduces"] is True and r["first_divergent_module"] == FAULT_MODULE
    fc1 = next(m for m in r["modules"] if (m["module"], m["tensor"]) == (FAULT_MODULE, "output"))
    # bf16 computes it well; cast to E4M3 (Config.formats) it saturates
    assert fc1["rel_l2"] < 0.02 and fc1["rel_l2_format"] > 0.5 and fc1["format"] == "e4m3"
    ex = r["explanation"]
    assert ex["kind"] == "format" and ex["format"] == "e4m3" and "448" in ex["text"]
