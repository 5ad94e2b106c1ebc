#!/bin/bash
# Session 10, device call A (H200, <= 560 s): compiled tests of the session-9 GPU paths, the
# cached-span TTFT (ttft_device_s9.sh), the float32 vs float64 truth check (f64_device_s9.sh).
export PYTHONPATH=$PWD JAX_COMPILATION_CACHE_DIR=/tmp/jcc MINIPIC_COMPILATION_CACHE_DIR=/tmp/jcc
export XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$SECONDS; git log --oneline -1 2>/dev/null
python3 -c "import xdist" 2>/dev/null && N="-n 4" || N=""
MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda timeout 220 python3 -m pytest -v -rfE -p no:cacheprovider \
  -o addopts= $N tests/test_paged_attention_mixed.py tests/test_paged_attention_mgpu_prefill.py \
  tests/test_runner_step_ops.py tests/test_gated_delta.py tests/test_gated_delta_affine.py \
  tests/test_span_maps.py > $OUT/compiled_tests.txt 2>&1
echo "compiled tests rc=$? xdist='$N' t=$((SECONDS-T0))"; tail -25 $OUT/compiled_tests.txt | grep -E "passed|failed|FAILED|ERROR" | cut -c1-200
timeout 230 bash benchmarks/history/scripts/ttft_device_s9.sh 2>&1 | tail -8; echo "ttft t=$((SECONDS-T0))"
timeout 120 bash benchmarks/history/scripts/f64_device_s9.sh 2>&1 | tail -16; echo "f64 t=$((SECONDS-T0))"
