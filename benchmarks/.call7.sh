export PYTHONPATH=. STABILITYWATCH_REAL_TRITON=1
timeout 130 python -m pytest -q -x tests/test_kernel_gpu.py tests/test_fp8_gpu.py > $OUT/tests.txt 2>&1
tail -2 $OUT/tests.txt
timeout 60 python benchmarks/bench_stats.py --variants --dtypes "bf16" --match "8 programs" --mib "96;256" > $OUT/variants.txt 2>&1
timeout 260 python benchmarks/diagnose_timeline.py --events 30 --configs "none;default;default-nocapture;full;full-nosnap;full-devsnap" > $OUT/timeline.txt 2>&1
cat $OUT/variants.txt; grep -v "^  host" $OUT/timeline.txt | tail -20
