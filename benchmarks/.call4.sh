export PYTHONPATH=. STABILITYWATCH_REAL_TRITON=1
timeout 200 python benchmarks/bench_stats.py --variants --dtypes "bf16;fp32" --mib "24;96" --match "programs" > $OUT/variants.txt 2>&1
timeout 150 python benchmarks/diagnose_step.py --config full > $OUT/step_full.txt 2>&1
timeout 150 python benchmarks/diagnose_step.py > $OUT/step_default.txt 2>&1
cat $OUT/variants.txt; grep -v "ms stabilitywatch" $OUT/step_full.txt | head -80
