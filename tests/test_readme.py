"""The README's loop example runs as written."""
import json
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs(tmp_path, monkeypatch, capsys):
    text = README.read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert "sw.watch(" in block and "mon.step(" in block
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.strip() == "[]"
    recs = [json.loads(line) for line in open(tmp_path / "runs/example/stats.jsonl")]
    assert {r["step"] for r in recs if r["tensor"] == "output"} == set(range(10)) | {10, 20, 30, 40}
    assert {r["module"] for r in recs} == {"", "0", "2"}
