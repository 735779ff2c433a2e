"""The GPU benchmarks run in a tiny CPU size so that they cannot rot."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def test_bench_overhead_smoke(capsys):
    import bench_overhead
    assert bench_overhead.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| full coverage, every step |" in out and "| detect_anomaly |" in out


def test_bench_overhead_interleaved_rounds(capsys):
    import bench_overhead
    assert bench_overhead.main(["--smoke", "--repeats", "2", "--configs",
                                "no monitor;default config without sinks"]) == 0
    out = capsys.readouterr().out
    assert "2 round(s)" in out and "| default config without sinks |" in out


@pytest.mark.interpreter
def test_bench_stats_smoke(capsys):
    import bench_stats
    assert bench_stats.main(["--smoke"]) == 0
    assert "| 2^12 | e4m3 |" in capsys.readouterr().out


@pytest.mark.interpreter
def test_bench_multi_smoke(capsys):
    import bench_multi
    assert bench_multi.main(["--smoke", "--per-prog", "8;32"]) == 0
    out = capsys.readouterr().out
    assert "| float32 |" in out and "| bfloat16 |" in out and out.count("\n| ") == 5


def test_bench_demo_overhead_smoke(capsys):
    import bench_demo_overhead
    assert bench_demo_overhead.main(["--smoke"]) == 0
    assert "| no monitor |" in capsys.readouterr().out


def test_bench_frame_smoke(capsys):
    import bench_frame
    assert bench_frame.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| frame | rows |" in out and "| unsampled |" in out and "| detector 'drift' |" in out


def test_diagnose_unsampled_smoke(capsys):
    import diagnose_unsampled
    assert diagnose_unsampled.main(["--smoke", "--steps", "2"]) == 0
    assert "| us/step (default - none) |" in capsys.readouterr().out


def test_diagnose_host_smoke(capsys):
    import diagnose_host
    assert diagnose_host.main(["--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "| no monitor |" in out and "| full config |" in out


def test_diagnose_record_smoke(capsys):
    import diagnose_record
    assert diagnose_record.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| Monitor._record |" in out and "| StatsBuffer.add |" in out


def test_diagnose_record_step_smoke(capsys):
    import diagnose_record
    assert diagnose_record.main(["--smoke", "--step", "every=1,nocap,nosinks"]) == 0
    rows = {r.split("|")[1].strip(): r.split("|")[2:-1]
            for r in capsys.readouterr().out.splitlines() if r.startswith("| ")}
    assert {"begin", "forward", "backward", "optimizer", "end", "step"} <= set(rows)
    for part in ("forward", "backward", "optimizer"):   # rows written, calls counted
        assert float(rows[part][3]) > 0 and int(rows[part][7]) > 0, rows[part]


@pytest.mark.interpreter  # its smoke size runs the kernels on CPU tensors
def test_diagnose_launches_smoke(capsys):
    import diagnose_launches
    assert diagnose_launches.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| one tensor | bf16 |" in out and "| many small | fp32 |" in out
    assert "all launches:" in out


def test_bench_torchao_smoke(capsys):
    # HF Llama and torchao's float8 emulation at tiny shapes: ~10 s of CPU, most of it imports
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    import bench_torchao
    assert bench_torchao.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    for kind in ("no monitor", "watch (default)", "watch_float8 (default)",
                 "watch_float8, every step"):
        assert f"| {kind} |" in out


def test_diagnose_step_kernels_smoke(capsys):
    import diagnose_step_kernels
    assert diagnose_step_kernels.main(["--smoke", "--configs", "none;every=1", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "llama, every=1: CPU op (self) time per step over none's" in out
    assert out.count("\n| ") >= 6   # the header and five names
