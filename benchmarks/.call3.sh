export PYTHONPATH=. STABILITYWATCH_REAL_TRITON=1
timeout 200 python -m pytest -q -x tests/test_kernel_gpu.py tests/test_fp8_gpu.py tests/test_monitor_gpu.py tests/test_capture_gpu.py tests/test_staging.py tests/test_compile.py > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt
timeout 150 python benchmarks/bench_stats.py --variants --dtypes "bf16;fp32;e4m3" --match "prefetch;programs" > $OUT/variants.txt 2>&1
timeout 200 python benchmarks/bench_stats.py --no-compile > $OUT/sizes.txt 2>&1
timeout 240 python benchmarks/diagnose_timeline.py --events 30 --configs "none;default;full" > $OUT/timeline.txt 2>&1
cat $OUT/variants.txt $OUT/sizes.txt; tail -25 $OUT/timeline.txt
