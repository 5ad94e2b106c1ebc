#!/bin/bash
# The second device call after session 30 (<= 9.7 min): rag's 1,024-token plain and warm steps
# as today / finals_in_place / pad_logits (the 16-row head: a 0.71 ms cuBLAS kernel inside the
# step, 0.17 ms alone), one process, profiled; the head alone in the step's own form (gathered
# rows, final norm; with a barrier; padded); issue 29's span request (reordered ratio).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s31b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s31
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s31b.txt
left() { echo $((${TOTAL:-570} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
timeout 150 python3 -m benchmarks.span_step_work --time qwen3_5_0_8b --dtype bfloat16 --reps 9 \
  --variants plain warm/0 --forms new finals_in_place pad_logits --profile 6 > "$OUT/steps.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy|nvjet" "$OUT/steps.txt" | cut -c1-150 >> "$R"
timeout 40 python3 -m benchmarks.lm_head_forms --rows 16 --reps 20 --forms in_step \
  in_step_barrier rows64 > "$OUT/lm_head.txt" 2>&1
echo "lm_head_forms rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^rows" "$OUT/lm_head.txt" | cut -c1-150 >> "$R"
L=$(left); [ "$L" -gt 330 ] && L=330
[ "$L" -ge 240 ] && OUT=$OUT LIMIT=$L EXTRA="--profile-top 15" bash benchmarks/runs/span_request_device.sh >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
