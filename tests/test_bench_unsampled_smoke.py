"""benchmarks/bench_unsampled.py runs end to end on a tiny size, so that it cannot rot, and its
table shows the unsampled step without a forward hook."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def test_bench_unsampled_smoke(capsys):
    import bench_unsampled
    assert bench_unsampled.main(["--device", "cpu", "--steps", "12", "--skip", "10",
                                 "--repeats", "1"]) == 0
    rows = {r.split("|")[2].strip().split(" ")[0]: r.split("|")
            for r in capsys.readouterr().out.splitlines() if r.startswith("| ")}
    assert {"every", "unsampled", "sampled"} <= rows.keys()
    assert rows["unsampled"][-8].strip() == "0"   # forward hooks on the watched modules
    assert int(rows["sampled"][-8]) > 0
