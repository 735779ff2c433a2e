"""`stabilitywatch report RUN_DIR`: the page written from a real monitored run with a fault."""
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

import pytest

import stabilitywatch as sw
from stabilitywatch import cli

from capture_models import train

REPO = Path(__file__).resolve().parents[1]
FAULT_STEP = 4


class Page(HTMLParser):
    """The page's links, its elements that fetch something, and the incident table's rows."""

    def __init__(self, text):
        super().__init__()
        self.links, self.fetching, self.rows, self.svgs, self._row = [], [], [], 0, None
        self._depth = 0
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "a" and "href" in a:
            self.links.append(a["href"])
        inline = (a.get("xlink:href") or a.get("href") or "").startswith("data:")
        if tag in ("script", "link", "img", "iframe", "object", "embed") or \
                (tag == "image" and not inline):
            self.fetching.append((tag, a))
        if tag == "svg":
            self.svgs += 1
        if tag == "tr":
            self._row = []
            self.rows.append(self._row)

    def handle_data(self, data):
        if self._row is not None:
            self._row.append(data)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real monitored run whose fc2 overflows fp16 at FAULT_STEP (about 5 s on a loaded CPU):
    the page is judged on what the monitor writes, bundles included."""
    d = tmp_path_factory.mktemp("run") / "r"
    cfg = sw.Config(every=1, sinks=("jsonl",), formats={"output": "fp16"})
    train(d, steps=7, fault_step=FAULT_STEP, config=cfg)
    return d


@pytest.fixture(scope="module")
def page_text(run_dir):
    return report(run_dir)


def critical(run_dir):
    lines = [json.loads(x) for x in (run_dir / "alerts.jsonl").read_text().splitlines()]
    return next(a for a in lines if a["severity"] == "critical" and a["capture"])


def report(run_dir, *extra):
    assert cli.main(["report", str(run_dir), *extra]) == 0
    return (run_dir / "report.html").read_text()


def test_page_lists_the_critical_alert_with_its_module_and_bundle(run_dir, page_text):
    alert = critical(run_dir)
    page = Page(page_text)
    row = next(" ".join(r) for r in page.rows if "critical" in r and str(alert["step"]) in r
               and alert["module"] in r)
    assert alert["tensor"] in row and alert["detector"] in row
    bundle_links = [h for h in page.links if unquote(h).startswith("captures/")]
    assert unquote(bundle_links[0]) == alert["capture"]
    assert all((run_dir / unquote(h)).is_dir() for h in bundle_links)
    assert (run_dir / alert["capture"] / "manifest.json").is_file()


def test_page_holds_the_curves_and_heatmaps_and_fetches_nothing(run_dir, page_text):
    text = page_text
    page = Page(text)
    assert page.fetching == []
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//", text, re.I)
    for role in ("output", "grad_output", "weight", "grad"):
        assert f"<h3>{role}</h3>" in text
    assert page.svgs == 1 + 4           # curves, one heatmap figure per role
    assert "fp16 overflow fraction" in text and "fp16 underflow fraction" in text
    assert "log2 absmax" in text and ">loss<" in text and "gradient norm" in text
    assert "<code>formats</code>" in text and json.loads((run_dir / "run.json").read_text())[
        "versions"]["torch"] in text


def test_replay_verdict_beside_the_bundle_is_shown(run_dir, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(run_dir, run)
    bundle = run / critical(run)["capture"]
    before = report(run)
    assert ("not replayed: <code>stabilitywatch replay " + str(bundle) + " --model-factory "
            "capture_models:build --step-fn capture_models:step_fp16 --json "
            + str(bundle) + ".replay.json</code>") in before
    rep = sw.replay(str(bundle), model_factory="capture_models:build",
                    step_fn="capture_models:step_fp16", json_file=str(bundle) + ".replay.json",
                    progress=False)
    text = report(run)
    assert "not replayed" not in text.split(critical(run)["capture"], 1)[1].split("</tr>")[0]
    label = "reproduces" if rep["reproduces"] else "does not reproduce"
    assert label in text
    if rep["first_divergent_module"]:
        assert f"departs at {rep['first_divergent_module']}" in text
    assert html.escape(f"verdict ({rep['verdict']['kind']}): {rep['verdict']['text']}") in text
    assert Page(text).links.count(f"captures/{bundle.name}.replay.json") == 1


def test_incidents_root_first_with_consequences_counted(tmp_path):
    lines = [
        {"step": 3, "severity": "warning", "detector": "overflow", "module": "b",
         "tensor": "output", "stat": "fp16_overflow_frac", "value": 0.5, "message": "m-b",
         "capture": None, "incident": "s3-1", "root": False},
        {"step": 3, "severity": "critical", "detector": "nonfinite", "module": "a",
         "tensor": "grad", "stat": "inf", "value": "inf", "message": "m-a", "capture": None,
         "incident": "s3-1", "root": True},
        {"step": 3, "severity": "info", "detector": "drift", "module": "c", "tensor": "weight",
         "stat": "log2_absmax", "value": "nan", "message": "m-c", "capture": "../../etc",
         "incident": "s3-1", "root": False},
        {"step": 5, "severity": "critical", "detector": "nonfinite", "module": "d",
         "tensor": "output", "stat": "nan", "value": "nan", "message": "m-d",
         "capture": "captures/step00000005-rank0", "incident": "s3-1", "root": False},
    ]
    (tmp_path / "captures" / "step00000005-rank0").mkdir(parents=True)
    (tmp_path / "alerts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"ste')
    text = report(tmp_path)
    assert text.index("m-a") < text.index("m-b") < text.index("m-c")
    assert "3 consequence(s): 1 critical, 1 warning, 1 info" in text
    assert "1 unreadable line(s) skipped (alerts.jsonl:5)" in text
    # the incident's row names every bundle of its alerts; one outside the run dir is no link
    root_row = text.split("m-a", 1)[1].split("</tr>", 1)[0]
    assert "href='captures/step00000005-rank0'" in root_row
    assert "../../etc</code> (missing)" in root_row
    assert not any(".." in h for h in Page(text).links)
    assert "No loss or gradient-norm records" in text and "no stats.jsonl" in text


def test_what_runs_leave_cut_lines_strings_rank_files(run_dir, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(run_dir, run)
    stats = (run / "stats.jsonl").read_text().splitlines()
    rec = json.loads(stats[0])
    rec["stats"] = {**rec["stats"], "absmax": "inf", "mean": "nan", "nan": "nan"}
    (run / "stats.jsonl").unlink()
    (run / "run.json").unlink()
    # rank 1's file only, a line of strings, and a cut last line
    (run / "stats.rank1.jsonl").write_text("\n".join(stats[1:] + [json.dumps(rec)]) + "\n"
                                           + stats[0][:40])
    text = report(run)
    assert "statistics from stats.rank1.jsonl" in text
    assert "unreadable line(s) skipped (stats.rank1.jsonl:" in text
    assert "No readable <code>run.json</code>" in text
    assert Page(text).svgs == 5
    (run / "stats.rank1.jsonl").write_text("")
    text = report(run)
    assert "No loss or gradient-norm records" in text and "No module statistics" in text


def synthetic(run, modules=50, steps=100):
    with open(run / "stats.jsonl", "w") as f:
        for s in range(steps):
            for m in range(modules):
                st = {"absmax": 2.0 ** (m % 7), "nan": 0, "posinf": 0, "neginf": 0,
                      "fp16_overflow_frac": 0.0, "fp16_underflow_frac": 0.01 * (s % 3)}
                f.write(json.dumps({"step": s, "module": f"layers.{m}", "tensor": "output",
                                    "stats": st}) + "\n")
            f.write(json.dumps({"step": s, "module": "", "tensor": "grad_norm",
                                "stats": {"l2norm": 1.0 + s, "nonfinite": 0}}) + "\n")
            if s % 10 == 0:   # loss on sampled steps only, grad norm every step
                f.write(json.dumps({"step": s, "module": "", "tensor": "loss",
                                    "stats": {"mean": 3.0, "nan": 0, "posinf": 0}}) + "\n")
    (run / "alerts.jsonl").write_text(json.dumps(
        {"step": 77, "severity": "critical", "detector": "overflow", "module": "layers.33",
         "tensor": "output", "stat": "fp16_overflow_frac", "value": 0.2, "message": "x",
         "capture": None}) + "\n")


def test_large_runs_are_sampled_and_say_so(tmp_path):
    synthetic(tmp_path)
    text = report(tmp_path, "--max-modules", "10", "--max-steps", "20")
    assert "heatmap output: 10 of 50 modules" in text
    assert "100 recorded steps in 20 columns of 5 consecutive recorded steps" in text
    assert "layers.33</text>" in text      # the module an alert names stays a row
    assert "layers.0</text>" in text and "layers.49</text>" in text
    assert ">loss<" in text and "gradient norm" in text


def test_bad_path_and_bad_arguments_one_line_exit_2(tmp_path, capsys):
    cases = [[str(tmp_path / "nope")], [str(tmp_path)], [str(tmp_path / "f")],
             [str(tmp_path), "--formats", "bf8"]]
    (tmp_path / "f").write_text("x")
    for argv in cases:
        assert cli.main(["report", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("stabilitywatch report: error: ") and "\n" not in err, err
    synthetic(tmp_path)
    for argv in (["--out", str(tmp_path / "no" / "dir.html")], ["--roles", "outptu"]):
        assert cli.main(["report", str(tmp_path), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("stabilitywatch report: error: ") and "\n" not in err, err
    assert "'outptu' has no statistics in this run (roles read: output)" in err


def test_without_matplotlib_says_what_to_install(tmp_path):
    synthetic(tmp_path)
    code = ("import sys; sys.modules['matplotlib'] = None; from stabilitywatch.cli import main; "
            f"sys.exit(main(['report', {str(tmp_path)!r}]))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "stabilitywatch report needs matplotlib: pip install 'stabilitywatch[report]'"]
    assert not (tmp_path / "report.html").exists()


def test_out_elsewhere_keeps_links_working(run_dir, tmp_path):
    out = tmp_path / "elsewhere" / "page.html"
    out.parent.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "stabilitywatch", "report", str(run_dir), "--out",
                        str(out)], capture_output=True, text=True, env=env, timeout=180)
    assert (r.returncode, r.stdout) == (0, f"report: {out}\n"), r.stderr
    links = [unquote(h) for h in Page(out.read_text()).links if "captures" in h]
    assert links and all((out.parent / h).resolve().is_dir() for h in links)
    assert cli.main(["report", str(run_dir), "--out", str(out.parent)]) == 0   # a directory
    assert (out.parent / "report.html").read_text().count("<svg") == 5


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="developer check: needs Debian's chromium "
                                             "(apt-get install chromium)")
def test_screenshot_in_headless_chromium_is_not_blank(run_dir, page_text, tmp_path):
    from matplotlib.image import imread

    shot = tmp_path / "shot.png"
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                        "--disable-background-networking", "--disable-component-update",
                        "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                        f"--screenshot={shot}", "--window-size=1400,2400",
                        (run_dir / "report.html").as_uri()],
                       capture_output=True, timeout=120, check=True)
    px = imread(shot)[..., :3]
    assert px.shape[:2] == (2400, 1400)
    inked = (px < 0.9).any(axis=2).mean()
    colourful = (px.max(axis=2) - px.min(axis=2) > 0.3).mean()   # heatmaps, severity badges
    assert inked > 0.05 and colourful > 0.02, (inked, colourful)


def test_long_timelines_keep_the_worst_incidents(tmp_path):
    from stabilitywatch.report.page import MAX_INCIDENTS, MAX_LISTED

    def alert(step, sev, module, **kw):
        return json.dumps({"step": step, "severity": sev, "detector": "drift", "module": module,
                           "tensor": "output", "stat": "x", "value": 1.0, "message": "m",
                           "capture": None, **kw}) + "\n"

    lines = [alert(s, "warning", f"w{s}") for s in range(MAX_INCIDENTS + 50)]
    lines += [alert(10_000, "critical", f"late{k}", incident="late", root=k == 0)
              for k in range(MAX_LISTED + 30)]
    (tmp_path / "alerts.jsonl").write_text("".join(lines))
    text = report(tmp_path)
    assert "<code>late0</code>" in text            # the critical incident, though the latest
    assert "... 29 more" in text and "<code>late200</code>" in text
    assert "<code>late201</code>" not in text
    assert "... 51 more group(s), less severe or later, not shown" in text
    assert f"<code>w{MAX_INCIDENTS - 2}</code>" in text
    assert f"<code>w{MAX_INCIDENTS}</code>" not in text
