"""The README's loop example runs as written."""
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from test_pacing import expected_sampled  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs(tmp_path, monkeypatch, capsys):
    text = README.read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert "sw.watch(" in block and "mon.step(" in block
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.strip() == "[]"
    recs = [json.loads(line) for line in open(tmp_path / "runs/example/stats.jsonl")]
    # every 10th step after the warm-up, stretched where the run's own times say the default
    # cost budget needs it (run.json: where and why)
    cadence = json.loads((tmp_path / "runs/example/run.json").read_text())["cadence"]
    assert {r["step"] for r in recs if r["tensor"] == "output"} == expected_sampled(50, cadence)
    assert {10, 20, 30} <= expected_sampled(50, cadence)
    assert {r["module"] for r in recs} == {"", "0", "2"}
