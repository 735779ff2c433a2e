"""benchmarks/bench_steps.py runs in a tiny CPU size (HF GPT-2 and Llama from tiny configs) so
that it cannot rot."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def test_bench_steps_smoke(capsys):
    import bench_steps
    assert bench_steps.main(["--smoke", "--models", "gpt2;llama",
                             "--configs", "none;default,nocap,nosinks"]) == 0
    out = capsys.readouterr().out
    assert "| gpt2 | default,nocap,nosinks |" in out and "| llama | none |" in out
