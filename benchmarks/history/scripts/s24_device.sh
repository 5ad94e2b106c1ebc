#!/bin/bash
# Session 24's first device call (one `run`, <= 9.5 min, raw files under $OUT): the warm span
# step's store A/B (span_step_work --forms new stacked_store no_zero_flags: the captured maps
# scattered per layer vs stacked first, the zero_a flags on / off; session 23's H200 profile put a
# 0.69 ms stack copy and a 0.5 ms reduce fusion in a warm step), then session 23's second call
# (s23_device.sh: compiled tests, rag at 16 seats, issue 29's span request, step profiles, the
# 64-seat fixed step) within what is left of TOTAL. Carry .dev1 as s23_device.sh says.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s24_device.sh
set -u; T0=$SECONDS
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHONPATH=$PWD JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
  JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s23 timeout 170 python3 -m benchmarks.span_step_work \
  --time qwen3_5_0_8b --dtype bfloat16 --reps 7 --variants warm/0 warm/4 \
  --forms new stacked_store no_zero_flags --profile 8 > "$OUT/store_forms.txt" 2>&1
echo "store forms rc=$? t=$((SECONDS-T0)) s"
grep -E "^(time|profile [a-z/0-9]+ [a-z_]+:)" "$OUT/store_forms.txt"
OUT=$OUT TOTAL=$((${TOTAL:-560} - SECONDS + T0)) bash benchmarks/history/scripts/s23_device.sh
