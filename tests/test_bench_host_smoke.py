"""benchmarks/bench_host.py runs end to end on a tiny size (so that it cannot rot) and times the
training thread's steps, sampled and unsampled apart."""
import importlib.util
import pathlib

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_host.py"


def test_bench_host_smoke(capsys):
    spec = importlib.util.spec_from_file_location("bench_host", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--smoke", "--models", "demo"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| demo |")]
    configs = {(r[1].strip(), r[2].split("(")[0].strip()) for r in rows}
    assert {("no monitor", "every"), ("default", "sampled"), ("default, inline", "sampled")} \
        <= configs
    for r in rows:
        assert float(r[3]) > 0 and float(r[6]) > 0   # CPU and wall ms of the training thread
