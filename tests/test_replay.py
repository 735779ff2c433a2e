"""Replay of a capture (tiny fp16 model) and refusal of bad bundles, without running their code."""
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stabilitywatch as sw
from stabilitywatch import cli
from stabilitywatch.capture.reader import CaptureError, open_capture
from stabilitywatch.capture.writer import MANIFEST, SUMS, sha256_file

import capture_models as cm

REPO = Path(__file__).resolve().parents[1]
NAMES = {"model_factory": "capture_models:build", "step_fn": "capture_models:step_fp16"}
FLAGS = ["--model-factory", NAMES["model_factory"], "--step-fn", NAMES["step_fn"]]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay") / "run"
    mon, _, _ = cm.train(out)
    return out / next(a.capture for a in mon.alerts if a.capture)


@pytest.fixture
def copy(bundle, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(bundle, dst)
    return dst


def test_round_trip_reproduces_and_names_the_module(bundle, tmp_path):
    out = tmp_path / "r.json"
    r = sw.replay(bundle, progress=False, json_file=out, **NAMES)
    assert r["reproduces"] is True and r["reproduce"]["rows_differing"] == 0
    assert r["first_divergent_module"] == "fc2"
    assert [m["module"] for m in r["modules"]][:4] == ["fc1", "fc2", "ln", "fc3"]
    fc1 = r["modules"][0]
    assert fc1["tensor"] == "output" and not fc1["divergent"] and fc1["rel_l2"] < 1e-2
    assert set(fc1) >= {"rel_l2", "sqnr_db", "cosine", "max_abs_err"}
    saved = json.loads(out.read_text())
    assert saved["reproduces"] is True and saved["first_divergent_module"] == "fc2"
    assert r["upcast"] is None


def test_upcast_what_if(bundle):
    fixed = sw.replay(bundle, progress=False, upcast=["fc2"], **NAMES)["upcast"]
    assert fixed["modules"] == ["fc2"] and fixed["anomaly_disappears"] is True
    assert fixed["remaining"] == []
    kept = sw.replay(bundle, progress=False, upcast="fc1", trust_recorded=True)["upcast"]
    assert kept["anomaly_disappears"] is False
    assert kept["remaining"] == ["nonfinite fc2 output inf"]


def test_a_different_computation_does_not_reproduce(bundle):
    r = sw.replay(bundle, progress=False, step_fn="capture_models:step_perturbed",
                  model_factory=NAMES["model_factory"])
    assert r["reproduces"] is False
    rp = r["reproduce"]
    assert rp["rows_differing"] > 0 and "does NOT reproduce" in rp["verdict"]
    d = rp["differences"][0]
    assert d["module"] == "fc1" and d["recorded"] != d["replayed"]


def test_progress_line_on_stderr(bundle, capsys):
    assert cli.main(["replay", str(bundle), "--json", "-", *FLAGS]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["first_divergent_module"] == "fc2"
    for phase in ("[1/6] verifying the bundle", "[2/6] building the model",
                  "[3/6] re-running the step as recorded", "[4/6] recording the low-precision run",
                  "[5/6] recording the fp64 run", "[6/6] comparing module by module"):
        assert f"replay {phase}" in cap.err, cap.err


def test_inspect(bundle, capsys):
    assert cli.main(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert "step 3" in out and "nonfinite" in out and "checksums OK" in out
    assert "dict(x: F32[16, 8]" in out


# -- bad bundles: one line, exit 2, no code from the bundle runs ------------------------------
def _reseal(d: Path) -> None:
    """What a careful attacker does: recompute every checksum after swapping files."""
    m = json.loads((d / MANIFEST).read_text())
    for name in m["files"]:
        m["files"][name]["sha256"] = sha256_file(d / name)
        m["files"][name]["bytes"] = (d / name).stat().st_size
    (d / MANIFEST).write_text(json.dumps(m))
    names = sorted(set(m["files"]) | {MANIFEST})
    (d / SUMS).write_text("".join(f"{sha256_file(d / n)}  {n}\n" for n in names))


class Evil:
    marker = ""

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant_pickle(path: Path, marker: Path) -> None:
    Evil.marker = str(marker)
    with open(path, "wb") as f:
        pickle.dump({"weight": Evil()}, f)


def _damage(kind: str, d: Path, marker: Path) -> str:
    if kind == "missing":
        shutil.rmtree(d)
        return "does not exist"
    if kind == "truncated":
        p = d / "model.safetensors"
        p.write_bytes(p.read_bytes()[:100])
        return "model.safetensors is 100 bytes, manifest.json lists"
    if kind == "flipped-byte":
        p = d / "optimizer.safetensors"
        b = bytearray(p.read_bytes())
        b[-1] ^= 1
        p.write_bytes(bytes(b))
        return "checksum mismatch for optimizer.safetensors"
    if kind == "edited-manifest":
        m = json.loads((d / MANIFEST).read_text())
        m["step"] = 4
        (d / MANIFEST).write_text(json.dumps(m))
        return "checksum mismatch for manifest.json"
    if kind == "no-sums":
        (d / SUMS).unlink()
        return "SHA256SUMS is missing"
    if kind == "planted-pickle":
        _plant_pickle(d / "model.pt", marker)
        return "unexpected file(s) model.pt"
    if kind == "pickle-instead-of-safetensors":
        _plant_pickle(d / "model.safetensors", marker)
        _reseal(d)
        return "not a readable safetensors file"
    if kind == "not-a-bundle":
        (d / MANIFEST).unlink()
        return "no manifest.json"
    raise AssertionError(kind)


KINDS = ["missing", "truncated", "flipped-byte", "edited-manifest", "no-sums", "planted-pickle",
         "pickle-instead-of-safetensors", "not-a-bundle"]


@pytest.mark.parametrize("kind", KINDS, ids=KINDS)
def test_bad_bundle_one_line_error(kind, copy, tmp_path, capsys, monkeypatch):
    marker = tmp_path / "pwned"
    words = _damage(kind, copy, marker)

    def no_unpickling(*a, **k):
        raise AssertionError("a bundle must never be unpickled")
    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(torch, "load", no_unpickling)
    for verb in ("inspect", "replay"):
        assert cli.main([verb, str(copy), "--no-progress", *FLAGS] if verb == "replay"
                        else [verb, str(copy)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert words in err and "Traceback" not in err
    with pytest.raises(CaptureError):
        sw.replay(copy, progress=False, **NAMES)
    assert not marker.exists()


def test_bad_bundle_subprocess_has_no_traceback(copy, tmp_path):
    _damage("pickle-instead-of-safetensors", copy, tmp_path / "pwned")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    r = subprocess.run([sys.executable, "-m", "stabilitywatch", "replay", str(copy), *FLAGS],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("stabilitywatch replay: error:")
    assert not (tmp_path / "pwned").exists()


def test_replay_argument_errors(bundle, capsys):
    # --model: the hidden alias of --model-factory
    assert cli.main(["replay", str(bundle), "--model", "no_such_module:build",
                     "--trust-recorded", "--no-progress"]) == 2
    assert "cannot import model factory 'no_such_module:build'" in capsys.readouterr().err
    assert cli.main(["replay", str(bundle), "--upcast", "nothing*", "--no-progress",
                     *FLAGS]) == 2
    assert "matches no module" in capsys.readouterr().err
    assert open_capture(bundle / MANIFEST).step == 3      # the manifest's path also works
