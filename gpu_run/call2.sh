#!/bin/bash
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 && echo "torchao wheel installed"
export PYTHONPATH=$PWD:/tmp/site
echo "=== GPU tests"
STABILITYWATCH_REAL_TRITON=1 timeout 330 python3 -m pytest -q -p no:cacheprovider -rs -x --maxfail=8 \
  tests/test_monitor_gpu.py tests/test_kernel_gpu.py tests/test_capture_gpu.py tests/test_fp8_gpu.py \
  tests/test_compile.py tests/test_staging.py tests/test_buffer_spans.py tests/test_replay_verdicts.py \
  tests/test_integrations_torchao_gpu.py tests/test_sentinel.py tests/test_hook_cost.py tests/test_kernel_constants.py \
  tests/test_capture_unsampled.py tests/test_processing.py tests/test_guard.py tests/test_kernel_multi.py \
  tests/test_waits_gpu.py tests/test_distributed_device_gpu.py tests/test_record_path.py tests/test_record_cost.py \
  tests/test_unsampled_step.py tests/test_launch.py > $OUT/gputests.log 2>&1
echo "pytest exit $?"; grep -E '^(FAILED|ERROR)|passed|failed' $OUT/gputests.log | tail -15
echo "=== bench_steps eager"
timeout 200 python3 benchmarks/bench_steps.py --models "llama;gpt2" --configs "none;default;every=1" --repeats 2 > $OUT/steps_eager.log 2>&1
echo "exit $?"; grep "^|" $OUT/steps_eager.log | tail -9
