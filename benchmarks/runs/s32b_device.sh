#!/bin/bash
# The second device call after session 31 (<= 9.5 min): issue 29's span request with the GDN
# finals in place (on since session 31: its cold and plain calls' prefill steps are plain
# steps), and rag's 1,024-token plain step with them and scattered (`finals_scattered`) now that
# the bench heads one row per sequence as the engine does; then the 32K GDN layer against fla
# (carry `.whl`: fla-core and einops wheels) if time is left.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s32b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s32
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s32b.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
OUT=$OUT LIMIT=300 EXTRA="--profile-top 12" bash benchmarks/runs/span_request_device.sh >> "$R"
L=$(left); [ "$L" -gt 120 ] && L=120
[ "$L" -ge 60 ] && timeout $L python3 -m benchmarks.span_step_work --time qwen3_5_0_8b \
  --dtype bfloat16 --reps 9 --variants plain warm/0 --forms new finals_scattered --profile 6 \
  > "$OUT/steps.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps.txt" | cut -c1-150 >> "$R"
L=$(left)
[ "$L" -ge 60 ] && OUT=$OUT LIMIT=$L bash benchmarks/runs/gdn32k_device.sh >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
