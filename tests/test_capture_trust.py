"""A capture is untrusted input. Tampered bundles, resealed the way an attacker would (every
checksum recomputed), must not make replay import, call, follow or read anything the user did
not name; links, FIFOs and devices are refused fast; each refusal is one line and exit 2."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

import stabilitywatch as sw
from stabilitywatch import cli
from stabilitywatch.capture.reader import CaptureError, open_capture
from stabilitywatch.capture.report import Progress
from stabilitywatch.capture.writer import MANIFEST, SUMS

import capture_models as cm

REPO = Path(__file__).resolve().parents[1]
FLAGS = ["--model-factory", "capture_models:build", "--step-fn", "capture_models:step_fp16"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("trust") / "run"
    mon, _, _ = cm.train(out)
    return out / next(a.capture for a in mon.alerts if a.capture)


@pytest.fixture
def copy(bundle, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(bundle, dst)
    return dst


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def reseal(d: Path, edit=None, sizes: bool = True) -> None:
    """Edit the manifest, then recompute what anyone can: the files' checksums and sizes (read
    through links, as an attacker's own tools would), the manifest's, SHA256SUMS."""
    m = json.loads((d / MANIFEST).read_text())
    if edit is not None:
        edit(m)
    for name in m["files"]:
        if (d / name).is_file():
            m["files"][name]["sha256"] = _sha(d / name)
            if sizes:
                m["files"][name]["bytes"] = (d / name).stat().st_size
    (d / MANIFEST).write_text(json.dumps(m))
    names = sorted({n for n in m["files"] if "/" not in n} | {MANIFEST})  # as SUMS can hold
    (d / SUMS).write_text("".join(f"{m['files'][n]['sha256'] if n != MANIFEST else _sha(d / n)}"
                                  f"  {n}\n" for n in names))


def refused(capsys, argv, *words):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


class FakeTTY:
    def __init__(self):
        self.parts = []

    def isatty(self):
        return True

    def write(self, s):
        self.parts.append(s)

    def flush(self):
        pass


# -- names only the bundle supplies are never imported or called -----------------------------
def test_recorded_torch_save_is_not_called(copy, tmp_path, capsys):
    # the attack from the issue: step_fn torch:save and a "batch" that is a path outside
    target = tmp_path / "victim.txt"
    target.write_text("precious")

    def edit(m):
        m["step_fn"] = "torch:save"
        m["batch"] = {"t": "value", "v": str(target)}
    reseal(copy, edit)
    err = refused(capsys, ["replay", str(copy), "--no-progress"],
                  "--model-factory PKG.MOD:FN --step-fn PKG.MOD:FN", "--trust-recorded")
    assert "torch:save" not in err               # not offered as a command to copy
    # naming only the factory is not enough: the step function would still be the bundle's
    err = refused(capsys, ["replay", str(copy), "--no-progress", "--model-factory",
                           "capture_models:build"], "pass --step-fn PKG.MOD:FN (")
    assert "--model-factory PKG" not in err
    with pytest.raises(CaptureError, match="trust_recorded=True"):
        sw.replay(copy, progress=False)
    assert target.read_text() == "precious"


def test_recorded_factory_is_not_called(copy, tmp_path, capsys, monkeypatch):
    spot = tmp_path / "tmpdirs"
    spot.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spot))      # where mkdtemp would create one
    reseal(copy, lambda m: m.update(model_factory="tempfile:mkdtemp"))
    refused(capsys, ["replay", str(copy), "--no-progress"], "--model-factory", "--trust-recorded")
    refused(capsys, ["replay", str(copy), "--no-progress", "--step-fn",
                     "capture_models:step_fp16"], "pass --model-factory PKG.MOD:FN (")
    assert list(spot.iterdir()) == []


def test_recorded_module_is_not_imported(copy, tmp_path, capsys, monkeypatch):
    marker = tmp_path / "imported"
    mod_dir = tmp_path / "site"
    mod_dir.mkdir()
    (mod_dir / "sw_planted_mod.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef build():\n    raise SystemExit('ran')\n")
    monkeypatch.syspath_prepend(str(mod_dir))
    reseal(copy, lambda m: m.update(model_factory="sw_planted_mod:build",
                                    step_fn="sw_planted_mod:build"))
    refused(capsys, ["replay", str(copy), "--no-progress"], "--trust-recorded")
    with pytest.raises(CaptureError):
        sw.replay(copy, progress=False)
    assert "sw_planted_mod" not in sys.modules and not marker.exists()
    # inspect shows the names and the command lines, and imports nothing either
    assert cli.main(["inspect", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "model_factory: sw_planted_mod:build" in out
    assert f"stabilitywatch replay {copy} --trust-recorded" in out
    assert (f"stabilitywatch replay {copy} --model-factory sw_planted_mod:build "
            f"--step-fn sw_planted_mod:build") in out
    assert "sw_planted_mod" not in sys.modules and not marker.exists()


def test_recorded_name_with_terminal_escapes(copy, capsys):
    evil = "capture_models:build\x1b[2K\rcapture_models:build"
    reseal(copy, lambda m: m.update(model_factory=evil))
    assert cli.main(["inspect", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out
    assert "not an import path" in out and "--trust-recorded" not in out
    refused(capsys, ["replay", str(copy), "--no-progress", "--trust-recorded"],
            "not an import path")


def test_recorded_optimizer_class_outside_torch_optim_classes(copy):
    def edit(m):
        m["optimizer"]["class"] = "torch.optim.lr_scheduler.LambdaLR"
    reseal(copy, edit)
    with pytest.raises(CaptureError, match="not one of torch.optim's"):
        sw.replay(copy, progress=False, model_factory="capture_models:build",
                  step_fn="capture_models:step_fp16")


def test_names_given_serve_when_the_run_recorded_none(copy, capsys):
    reseal(copy, lambda m: m.update(model_factory=None, step_fn=None))
    refused(capsys, ["replay", str(copy), "--no-progress", "--trust-recorded"],
            "the capture records no model factory: pass --model-factory PKG.MOD:FN")
    assert cli.main(["replay", str(copy), "--no-progress", *FLAGS, "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["first_divergent_module"] == "fc2"


def test_trust_recorded_runs_the_recorded_names(bundle):
    # the positive control: confirmed names run, and the result is the normal report
    r = sw.replay(bundle, progress=False, trust_recorded=True)
    assert r["reproduces"] is True and r["first_divergent_module"] == "fc2"


# -- what the user's functions return is checked before it is used ----------------------------
def returns_a_path():
    return str(REPO)


def returns_a_vector(model, batch):
    return cm.step_fp16(model, batch).expand(4)


def returns_ints(model, batch):
    return torch.ones((), dtype=torch.int64)


def returns_detached(model, batch):
    return cm.step_fp16(model, batch).detach()


def test_factory_result_checked_before_anything_runs(bundle, monkeypatch):
    tty = FakeTTY()                     # a terminal: every phase is drawn as it starts
    monkeypatch.setattr(sys, "stderr", tty)
    with pytest.raises(CaptureError, match="returned a str, not a torch.nn.Module"):
        sw.replay(bundle, progress=True, model_factory="test_capture_trust:returns_a_path",
                  step_fn="capture_models:step_fp16")
    assert "verifying the bundle" in "".join(tty.parts)
    assert "re-running" not in "".join(tty.parts)          # refused before any step ran


@pytest.mark.parametrize("fn, words", [
    ("returns_a_vector", r"float32 tensor of shape \(4,\), not the loss"),
    ("returns_ints", r"torch.int64 tensor of shape \(\), not the loss"),
    ("returns_detached", "does not require grad"),
], ids=["vector", "integer", "detached"])
def test_step_result_checked(bundle, capsys, fn, words):
    with pytest.raises(CaptureError, match=words):
        sw.replay(bundle, progress=False, model_factory="capture_models:build",
                  step_fn=f"test_capture_trust:{fn}")
    refused(capsys, ["replay", str(bundle), "--no-progress", "--model-factory",
                     "capture_models:build", "--step-fn", f"test_capture_trust:{fn}"],
            "not the loss" if fn != "returns_detached" else "does not require grad")


# -- files: no links, only regular files, sizes as listed, names inside the bundle ------------
def test_symlink_to_a_valid_file_outside(copy, tmp_path, capsys):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(copy / "model.safetensors", outside)
    (copy / "model.safetensors").symlink_to(outside)     # same bytes: every checksum matches
    for verb in (["inspect"], ["replay", "--no-progress", *FLAGS]):
        refused(capsys, [verb[0], str(copy), *verb[1:]], "model.safetensors is a symbolic link")
    with pytest.raises(CaptureError, match="symbolic link"):
        open_capture(copy)


def test_symlink_to_etc_passwd(copy, capsys):
    if not Path("/etc/passwd").is_file():
        pytest.skip("no /etc/passwd on this system")
    (copy / "batch.safetensors").unlink()
    (copy / "batch.safetensors").symlink_to("/etc/passwd")
    reseal(copy)
    for verb in (["inspect"], ["replay", "--no-progress", *FLAGS]):
        refused(capsys, [verb[0], str(copy), *verb[1:]], "batch.safetensors is a symbolic link")


CHILD = textwrap.dedent("""
    import sys, time
    from stabilitywatch import cli
    flags = sys.argv[1:5]
    for path in sys.argv[5:]:
        t = time.perf_counter()
        rc = [cli.main(["inspect", path]), cli.main(["replay", path, "--no-progress", *flags])]
        print(rc, round(time.perf_counter() - t, 2), flush=True)
""")


def test_rng_as_fifo_or_dev_zero_fails_fast(bundle, tmp_path):
    # the original checksums stay (nothing can hash these); an unbounded read or a blocking open
    # would hang: the child is killed by the timeout and the test fails
    paths = []
    for kind in ("fifo", "dev-zero"):
        d = tmp_path / kind
        shutil.copytree(bundle, d)
        (d / "rng.safetensors").unlink()
        if kind == "fifo":
            os.mkfifo(d / "rng.safetensors")
        else:
            (d / "rng.safetensors").symlink_to("/dev/zero")
        paths.append(str(d))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    r = subprocess.run([sys.executable, "-c", CHILD, *FLAGS, *paths], capture_output=True,
                       text=True, env=env, timeout=120)
    results = r.stdout.strip().splitlines()
    assert len(results) == 2, r.stdout + r.stderr
    for line in results:
        rcs, seconds = line.rsplit(" ", 1)
        assert rcs == "[2, 2]" and float(seconds) < 5, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 4 and "Traceback" not in r.stderr, r.stderr
    for line, word in zip(lines, ["not a regular file"] * 2 + ["is a symbolic link"] * 2):
        assert "rng.safetensors" in line and word in line, r.stderr


def test_size_differs_from_the_manifest(copy, capsys):
    def edit(m):
        m["files"]["optimizer.safetensors"]["bytes"] += 1
    reseal(copy, edit, sizes=False)
    for verb in (["inspect"], ["replay", "--no-progress", *FLAGS]):
        refused(capsys, [verb[0], str(copy), *verb[1:]], "optimizer.safetensors is",
                "manifest.json lists")


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd"],
                         ids=["dot-dot", "absolute"])
def test_manifest_path_outside_the_bundle(copy, tmp_path, capsys, name):
    (tmp_path / "outside.safetensors").write_bytes((copy / "rng.safetensors").read_bytes())

    def edit(m):
        m["files"][name] = dict(m["files"]["rng.safetensors"])
    reseal(copy, edit)
    for verb in (["inspect"], ["replay", "--no-progress", *FLAGS]):
        refused(capsys, [verb[0], str(copy), *verb[1:]], "not a plain file name inside the bundle")


def test_loading_reads_what_was_verified(copy):
    # a file swapped after verification is caught on load: the bytes loaded are hashed
    cap = open_capture(copy)
    (copy / "batch.safetensors").write_bytes(b"\0" * (copy / "batch.safetensors").stat().st_size)
    with pytest.raises(CaptureError, match="changed after the bundle was verified"):
        cap.tensors("batch")


# -- progress while a phase runs -------------------------------------------------------------
def _wait_for(cond, seconds=10.0):
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_progress_redraws_while_a_phase_runs():
    tty = FakeTTY()
    bar = Progress(total=2, stream=tty, tick_s=0.02)
    bar.phase("a long phase")
    t = time.perf_counter()

    def draws():
        return [p for p in tty.parts if "a long phase" in p]
    try:
        assert _wait_for(lambda: len(draws()) >= 5), draws()   # redrawn while it runs
    finally:
        bar.close()
    assert draws()[0] != draws()[-1]                  # with the elapsed time moving
    assert time.perf_counter() - t < 10


def test_progress_in_a_log_names_long_phases_only():
    log = FakeTTY()
    log.isatty = lambda: False
    bar = Progress(total=2, stream=log, tick_s=0.01, after_s=0.1, quiet_s=0.1)
    bar.phase("quick")
    bar.phase("slow")
    try:
        assert _wait_for(lambda: "still running" in "".join(log.parts)), log.parts
    finally:
        bar.close()
    text = "".join(log.parts)
    assert "quick" not in text
    assert text.startswith("replay [2/2] slow (") and "still running" in text
