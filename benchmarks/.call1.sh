export PYTHONPATH=. STABILITYWATCH_REAL_TRITON=1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv > $OUT/smi.txt 2>&1
timeout 120 python benchmarks/diagnose_atoms.py > $OUT/atoms.txt 2>&1
timeout 280 python benchmarks/bench_stats.py --variants --dtypes "bf16;fp32;e4m3" > $OUT/variants.txt 2>&1
timeout 170 python -m pytest -q -x tests/test_staging.py tests/test_capture_gpu.py tests/test_monitor_gpu.py tests/test_kernel_gpu.py tests/test_fp8_gpu.py tests/test_compile.py > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt; cat $OUT/atoms.txt $OUT/variants.txt
