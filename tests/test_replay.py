"""Replay of a capture (tiny fp16 model) and refusal of bad bundles, without running their code."""
import io
import json
import os
import pickle
import re
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
    outputs = [m for m in r["modules"] if m["tensor"] == "output"]
    assert [m["module"] for m in outputs] == ["fc1", "fc2", "ln", "fc3"]
    fc1 = outputs[0]
    assert fc1["tensor"] == "output" and not fc1["divergent"] and fc1["rel_l2"] < 1e-2
    assert set(fc1) >= {"rel_l2", "sqnr_db", "cosine", "max_abs_err"}
    saved = json.loads(out.read_text())
    assert saved["reproduces"] is True and saved["first_divergent_module"] == "fc2"
    assert saved["ran"] == NAMES                        # what ran, as named
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


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_line_on_stderr(bundle, capsys, monkeypatch):
    tty = FakeTTY()          # on a terminal every phase is drawn as it starts (in a log: the
    monkeypatch.setattr(sys, "stderr", tty)    # phases that run longer than 1 s)
    assert cli.main(["replay", str(bundle), "--json", "-", *FLAGS]) == 0
    assert json.loads(capsys.readouterr().out)["first_divergent_module"] == "fc2"
    err = tty.getvalue()
    for phase in ("[1/6] verifying the bundle", "[2/6] building the model",
                  "[3/6] re-running the step as recorded", "[4/6] recording the low-precision run",
                  "[5/6] recording the fp64 run", "[6/6] comparing module by module"):
        assert f"\rreplay {phase}" in err, err


def test_inspect_progress_while_verifying(bundle, capsys, monkeypatch):
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert cli.main(["inspect", str(bundle)]) == 0
    assert "\rinspect [1/1] verifying checksums" in tty.getvalue()
    assert re.search(r"\d of \d+\.\d [kMG]B", tty.getvalue())  # bytes hashed of the total
    assert "checksums OK" in capsys.readouterr().out


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


# -- exit statuses ----------------------------------------------------------------------------
@pytest.mark.parametrize("step_fn, fail_on, status", [
    ("capture_models:step_fp16", [], 0),                          # departs, but not asked
    ("capture_models:step_fp16", ["--fail-on", "departs"], 4),
    ("capture_models:step_fp16", ["--fail-on", "not-reproduced"], 0),
    ("capture_models:step_perturbed", ["--fail-on", "not-reproduced"], 3),
    ("capture_models:step_perturbed", ["--fail-on", "departs,not-reproduced"], 3),
    ("capture_models:step_perturbed", ["--fail-on", "departs", "--fail-on", "departs"], 4),
], ids=["not-asked", "departs", "reproduces", "not-reproduced", "both-3-first", "repeated"])
def test_exit_status_follows_the_verdict(bundle, tmp_path, capsys, step_fn, fail_on, status):
    out = tmp_path / "r.json"
    argv = ["replay", str(bundle), "--no-progress", "--model-factory", "capture_models:build",
            "--step-fn", step_fn, "--json", str(out), *fail_on]
    assert cli.main(argv) == status
    r = json.loads(out.read_text())                 # the report is written whatever the status
    assert r["first_divergent_module"] == "fc2"
    assert r["reproduces"] is (step_fn == "capture_models:step_fp16")
    assert "first divergent module: fc2" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--fail-on", "diverges"], "diverges: expected not-reproduced or departs"),
    (["--fail-on", ""], "'': expected not-reproduced or departs"),
    (["--tol", "0"], "'0' is not a positive number"),
    (["--tol", "x"], "'x' is not a positive number"),
], ids=["unknown-fail-on", "empty-fail-on", "tol-0", "tol-not-a-number"])
def test_bad_replay_arguments_exit_2(bundle, capsys, argv, words):
    with pytest.raises(SystemExit) as ei:     # before anything is read or imported
        cli.main(["replay", str(bundle), "--model", "capture_models:build", "--step-fn",
                  "capture_models:step_fp16", *argv])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and "usage" in err and words in err, err


def test_bad_json_destination_is_refused_before_running(bundle, tmp_path, capsys):
    assert cli.main(["replay", str(bundle), *FLAGS, "--no-progress", "--json",
                     str(tmp_path / "no" / "such" / "dir" / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "--json" in err and len(err.strip().splitlines()) == 1


# -- the console script, from the directory that holds the user's model module ----------------
def console_script(tmp_path: Path) -> list[str]:
    """The installed `stabilitywatch` script of this interpreter, or the wrapper pip writes for
    pyproject's [project.scripts] entry (either way sys.path[0] is the script's directory, not
    the working directory)."""
    import tomllib

    entry = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry["stabilitywatch"] == "stabilitywatch.cli:main"
    exe = Path(sys.executable).parent / "stabilitywatch"
    if exe.is_file() and "from stabilitywatch.cli import main" in exe.read_text():
        return [sys.executable, str(exe)]
    script = tmp_path / "bin" / "stabilitywatch"
    script.parent.mkdir()
    script.write_text("import re\nimport sys\nfrom stabilitywatch.cli import main\n"
                      "if __name__ == '__main__':\n"
                      "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                      "    sys.exit(main())\n")
    return [sys.executable, str(script)]


def test_console_script_finds_the_factory_in_the_working_directory(bundle, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    src = (REPO / "tests" / "capture_models.py").read_text()
    (work / "my_models.py").write_text(src)
    # the module the capture records is also here: without --trust-recorded it stays unread
    (work / "capture_models.py").write_text(src + "\nopen('recorded-module-imported', 'w')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}         # the user's directory is not on it
    r = subprocess.run([*console_script(tmp_path), "replay", str(bundle), "--model-factory",
                        "my_models:build", "--step-fn", "my_models:step_fp16", "--json",
                        "out.json", "--no-progress"], cwd=work, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads((work / "out.json").read_text())
    assert rep["reproduces"] is True and rep["first_divergent_module"] == "fc2"
    assert not (work / "recorded-module-imported").exists()
