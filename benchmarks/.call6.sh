export PYTHONPATH=. STABILITYWATCH_REAL_TRITON=1
timeout 120 python -m pytest -q tests/test_capture_gpu.py tests/test_staging.py tests/test_monitor_gpu.py > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt
timeout 200 python benchmarks/bench_overhead.py --repeats 2 --configs "no monitor;default config;full coverage, every step;full coverage, no snapshots" > $OUT/overhead.txt 2>&1
cat $OUT/overhead.txt
