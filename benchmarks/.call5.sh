export PYTHONPATH=. STABILITYWATCH_REAL_TRITON=1
timeout 150 python -m pytest -q -x tests/test_kernel_gpu.py tests/test_fp8_gpu.py tests/test_monitor_gpu.py tests/test_compile.py > $OUT/tests.txt 2>&1
tail -2 $OUT/tests.txt
timeout 120 python benchmarks/bench_stats.py --no-compile > $OUT/sizes.txt 2>&1
timeout 170 python benchmarks/diagnose_timeline.py --events 30 --configs "none;default;full;full-nosnap" > $OUT/timeline.txt 2>&1
timeout 150 python benchmarks/bench_overhead.py --repeats 2 --configs "no monitor;default config;full coverage, every step;full coverage, no snapshots" > $OUT/overhead.txt 2>&1
cat $OUT/sizes.txt; grep -v "^  host" $OUT/timeline.txt | tail -14; cat $OUT/overhead.txt
