#!/bin/bash
# Session 28's third device call (<= 4.5 min, a short table last): the GDN conv's taps as static
# shifts (qwen3_5_gdn.CONV_SHIFTED) against the row gathers, in the span step variants at rag's
# 1,024 tokens x 16 seats (span_step_work forms) and the engine's plain prefill and decode steps
# at 64 seats (fixed_step_work, the decode profiled: the GDN decode's rows gathered after the
# output projection, session 27, expected ~399 kernels against session 26's 417).
# usage: OUT=$OUT [LIMIT_STEPS=140] [DECODE=0] bash benchmarks/history/scripts/s28c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s28c.txt
nvidia-smi -L > "$R" 2>/dev/null
timeout ${LIMIT_STEPS:-140} python3 -m benchmarks.span_step_work --time qwen3_5_0_8b --dtype bfloat16 --reps 9 \
  --variants plain warm/0 warm/4 --forms new conv_shifted --profile 8 > "$OUT/steps.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy|fusion" "$OUT/steps.txt" | grep -E "^time|kernels|convert|select|reduce" \
  | cut -c1-150 >> "$R"
[ "${DECODE:-1}" = 1 ] && timeout 110 python3 -m benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 \
  --tokens 1024 --ckpt 1 --decode --forms "" CONV_SHIFTED=1 --profile 8 > "$OUT/fixed.txt" 2>&1
echo "fixed_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -v "^W1" "$OUT/fixed.txt" | grep -E "ms|kernels" | tail -40 | cut -c1-170 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
