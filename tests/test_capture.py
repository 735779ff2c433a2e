"""Capture bundles: what they hold, start-of-step state, limits, write failures, config."""
import json
import logging

import pytest
import torch
from safetensors.torch import load_file

import stabilitywatch as sw
from stabilitywatch.capture.reader import open_capture
from stabilitywatch.capture.writer import MANIFEST, SUMS, sha256_file

import capture_models as cm

MANIFEST_KEYS = {"kind", "schema", "step", "rank", "world_size", "alerts", "config", "modules",
                 "model_factory", "step_fn", "versions", "device", "stats", "optimizer", "batch",
                 "rng", "files"}


def cfg(**kw):
    capture = kw.pop("capture", {})
    if isinstance(capture, (tuple, list)):   # a list is short for the triggers
        capture = {"triggers": tuple(capture)}
    capture = {"snapshot": "sampled", **capture}
    return sw.Config(**{"every": 1, "sinks": ("jsonl",), "capture": capture, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Fault at step 3; the state at the start of step 3 is recorded from inside the loop."""
    seen = {}

    def before(step, model, opt, batch):
        if step == 3:
            seen["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
            seen["exp_avg"] = opt.state[model.fc2.weight]["exp_avg"].clone()
            seen["rng"] = torch.get_rng_state()
            seen["batch"] = batch
    out = tmp_path_factory.mktemp("cap") / "run"
    mon, model, _ = cm.train(out, before_step=before)
    return out, mon, model, seen


def test_alert_points_to_a_complete_bundle(run):
    out, mon, _, _ = run
    crit = [a for a in mon.alerts if a.severity is sw.Severity.CRITICAL]
    assert crit and crit[0].step == 3 and crit[0].capture == "captures/step00000003-rank0"
    lines = [json.loads(x) for x in (out / "alerts.jsonl").read_text().splitlines()]
    assert [x["capture"] for x in lines if x["step"] == 3] == ["captures/step00000003-rank0"] * \
        sum(1 for x in lines if x["step"] == 3)
    bundle = out / crit[0].capture
    # escalated.json (and its checksum): the rows of the escalated steps 4 and 5 after it
    assert sorted(p.name for p in bundle.iterdir()) == sorted(
        [MANIFEST, SUMS, "model.safetensors", "optimizer.safetensors", "batch.safetensors",
         "rng.safetensors", "escalated.json", "escalated.sha256"])
    assert not [p for p in (out / "captures").iterdir() if p.name.startswith(".tmp")]
    m = json.loads((bundle / MANIFEST).read_text())
    assert MANIFEST_KEYS <= set(m)
    assert (m["step"], m["rank"], m["model_factory"]) == (3, 0, "capture_models:build")
    assert {"torch", "triton", "cuda", "python"} <= set(m["versions"])
    assert "gpu" in m["device"]
    # the fault (fc2's weights x1e5 at step start) is a bad write: the incident's root, first
    assert (m["alerts"][0]["detector"], m["alerts"][0]["root"]) == ("physics", True)
    assert "nonfinite" in [a["detector"] for a in m["alerts"]]
    assert len(m["stats"]["keys"]) == len(m["stats"]["rows"]) > 0
    assert ["fc2", "output"] in m["stats"]["keys"]
    for name, info in m["files"].items():
        assert sha256_file(bundle / name) == info["sha256"]
    sums = dict(line.split("  ")[::-1] for line in (bundle / SUMS).read_text().splitlines())
    assert set(sums) == set(m["files"]) | {MANIFEST}


def test_bundle_holds_the_start_of_step_state(run):
    out, mon, model, seen = run
    bundle = out / "captures/step00000003-rank0"
    weights = load_file(bundle / "model.safetensors")
    for k, v in seen["weights"].items():
        assert torch.equal(weights[k], v), k
    assert not torch.equal(weights["fc2.weight"], model.fc2.weight.detach())  # updated since
    opt_state = load_file(bundle / "optimizer.safetensors")
    assert torch.equal(opt_state["2.exp_avg"], seen["exp_avg"])   # fc2.weight is parameter 2
    assert torch.equal(load_file(bundle / "rng.safetensors")["torch"], seen["rng"])
    cap = open_capture(bundle)
    from stabilitywatch.capture.treeio import decode_tree
    batch = decode_tree(cap.manifest["batch"], cap.tensors("batch"))
    assert torch.equal(batch["x"], seen["batch"]["x"])
    assert torch.equal(batch["meta"]["ids"], seen["batch"]["meta"]["ids"])
    assert batch["meta"]["note"] == "synthetic" and batch["meta"]["scale"] == 1.5


def test_snapshot_ring_is_released_and_reused(run):
    _, mon, _, _ = run
    snap = mon.capture.snap
    assert all(s.step is None for s in snap.slots)       # nothing held after close()
    assert snap.skipped == 0 and not snap.disabled


@pytest.mark.parametrize("retention, steps", [("keep_first", [2, 3]), ("keep_last", [4, 5])],
                         ids=["keep_first", "keep_last"])
def test_retention_by_count(tmp_path, retention, steps):
    config = cfg(capture={"triggers": ("warning",), "max": 2, "retention": retention},
                 formats={"output": "fp16"}, incidents={"cooldown": 0})
    mon, _, _ = cm.train(tmp_path, steps=6, fault_step=2, config=config)
    names = sorted(p.name for p in (tmp_path / "captures").iterdir())
    assert names == [f"step{s:08d}-rank0" for s in steps]
    flagged = {a.step for a in mon.alerts}
    assert flagged == {2, 3, 4, 5}


def test_byte_limit_skips_with_one_warning(tmp_path, caplog):
    config = cfg(capture={"triggers": ("warning",), "max_bytes": 1000},
                 formats={"output": "fp16"}, incidents={"cooldown": 0})
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        mon, _, _ = cm.train(tmp_path, steps=6, fault_step=2, config=config)
    assert mon.alerts and all(a.capture is None for a in mon.alerts)
    msgs = [r.getMessage() for r in caplog.records if "not captured" in r.getMessage()]
    assert len(msgs) == 1 and "capture.max_bytes" in msgs[0]


def test_write_error_never_stops_training(tmp_path, caplog, monkeypatch):
    import safetensors.torch

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    config = cfg(capture=("warning",), formats={"output": "fp16"}, incidents={"cooldown": 0})
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        mon, _, _ = cm.train(tmp_path, steps=6, fault_step=2, config=config)
    assert mon.frames_seen == 6 and {a.step for a in mon.alerts} == {2, 3, 4, 5}
    assert all(a.capture is None for a in mon.alerts)
    msgs = [r.getMessage() for r in caplog.records if "capture of step" in r.getMessage()]
    assert len(msgs) == 1 and "No space left" in msgs[0]
    assert not list((tmp_path / "captures").iterdir())     # no half-written bundle


def test_unwritable_capture_dir(tmp_path, caplog):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    config = cfg(capture={"dir": str(blocker / "captures")})
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        mon, _, _ = cm.train(tmp_path / "run", config=config)
    assert mon.alerts and all(a.capture is None for a in mon.alerts)
    assert sum("capture of step" in r.getMessage() for r in caplog.records) == 1


def test_snapshot_policies(tmp_path):
    mon, _, _ = cm.train(tmp_path / "off", config=cfg(capture={"snapshot": "off"}))
    assert mon.alerts and all(a.capture is None for a in mon.alerts)
    assert mon.capture.snap.nbytes == 0
    mon, _, _ = cm.train(tmp_path / "none", config=cfg(capture=()))
    assert mon.capture is None and all(a.capture is None for a in mon.alerts)
    # sampled: every=4, warmup=0 -> steps 0 and 4 sampled; the fault at 3 shows only in the
    # loss, and its bundle says it lacks the start-of-step state (no snapshot of step 3)
    mon, _, _ = cm.train(tmp_path / "sampled", config=cfg(every=4, warmup=0, capture={"ring": 1}))
    at3 = [a for a in mon.alerts if a.step == 3]
    assert at3 and all(a.capture == "captures/step00000003-rank0" for a in at3)
    m = json.loads((tmp_path / "sampled" / at3[0].capture / MANIFEST).read_text())
    assert m["lacks"] == ["model", "optimizer"] and "sampled steps only" in m["lacks_why"]
    mon, _, _ = cm.train(tmp_path / "every", config=cfg(every=4, warmup=0,
                                                         capture={"snapshot": "every"}))
    assert [a.capture for a in mon.alerts if a.step == 3][:1] == ["captures/step00000003-rank0"]


@pytest.mark.parametrize("kw, field", [
    ({"capture": ["critical:loud"]}, "capture"),
    ({"capture": [3]}, "capture"),
    ({"capture": ["a:b:c"]}, "capture"),
    ({"capture": {"dir": ""}}, "capture.dir"),
    ({"capture": {"max": 0}}, "capture.max"),
    ({"capture": {"max_bytes": -1}}, "capture.max_bytes"),
    ({"capture": {"ring": True}}, "capture.ring"),
    ({"capture": {"retention": "keep_some"}}, "capture.retention"),
    ({"capture": {"snapshot": "sometimes"}}, "capture.snapshot"),
    ({"capture": {"snapshot_to": "disk"}}, "capture.snapshot_to"),
], ids=["bad-severity", "not-str", "two-colons", "empty-dir", "max-0", "bytes-negative",
        "ring-bool", "retention", "snapshot", "snapshot-to"])
def test_config_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        sw.Config(**kw)


def test_config_capture_entries_from_file(tmp_path):
    p = tmp_path / "sw.toml"
    p.write_text('[stabilitywatch.capture]\ntriggers = ["nonfinite", "overflow:critical"]\n'
                 'snapshot = "every"\nsnapshot_to = "host"\n')
    c = sw.Config.from_file(p)
    assert c.capture.triggers == ("nonfinite", "overflow:critical")
    assert c.capture.snapshot.value == "every" and c.capture.snapshot_to.value == "host"
