"""benchmarks/bench_capture.py runs end to end on a tiny size, so that it cannot rot."""
import importlib.util
import pathlib

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_capture.py"


def test_bench_capture_smoke(capsys):
    spec = importlib.util.spec_from_file_location("bench_capture", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--smoke", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "| configuration (cpu" in out and "snapshot (cpu" in out
    assert len(rows) == 6 and all(r["ms"] > 0 for r in rows)
    assert "default policy per step:" in out and rows[0]["copy_ms"] > 0
    r = rows[0]
    # one slot in use on the CPU (frames are read at the end of the step): params + AdamW state
    assert r["ring_bytes"] == r["param_bytes"] + r["optim_bytes"]
    assert r["host_ms"] > 0 and r["bundle_bytes"] > r["ring_bytes"]


def test_bench_capture_gpt2_smoke(capsys):
    spec = importlib.util.spec_from_file_location("bench_capture", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--model", "gpt2", "--smoke", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "# bench_capture gpt2 on cpu" in out and "ring held in training: 1 slot" in out
    assert out.rstrip().splitlines()[-1].startswith(
        "| default cadence (every 10), capture.snapshot='sampled' |")
    assert len(rows) == 6 and all(r["ms"] > 0 and r["peak_bytes"] is None for r in rows)
    r = rows[0]
    assert r["ring_bytes"] == r["slot_bytes"] == r["param_bytes"] + r["optim_bytes"]
    assert r["slots"] == 2 and r["bundle_bytes"] > r["ring_bytes"]
