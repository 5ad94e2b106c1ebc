#!/bin/bash
# The second device call of session 32 (<= 9.5 min): issue 29's span request with the GDN
# finals in place (on since session 31: its cold and plain calls' prefill steps are plain
# steps), its reordered prefill and decode profiled again with the checkpoint rows stored layer
# by layer (checkpoint_pool.CHECKPOINTS_STACKED=0: no [Lg, K] stack, session 32); the 64-seat
# 128- and 1,024-token prefill steps with the checkpoint pool in both store forms, alternated
# twice; then the 32K GDN layer against fla (carry `.whl`: fla-core and einops wheels) if time
# is left.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s32b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s32
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s32b.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
OUT=$OUT LIMIT=300 EXTRA="--profile-top 12 --profile-forms CHECKPOINTS_STACKED=0" \
  bash benchmarks/runs/span_request_device.sh >> "$R"
L=$(left); [ "$L" -gt 170 ] && L=170
[ "$L" -ge 80 ] && timeout $L python3 -m benchmarks.fixed_step_work --time --seats 64 \
  --max-model-len 25600 --tokens 128 1024 --ckpt 1 --reps 15 --profile 4 \
  --forms "" CHECKPOINTS_STACKED=0 "" CHECKPOINTS_STACKED=0 > "$OUT/ckpt_store_ab.txt" 2>&1
echo "checkpoint store A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^live_prerotate|^time |^profile prefill [^|]*:" "$OUT/ckpt_store_ab.txt" | cut -c1-170 >> "$R"
L=$(left)
[ "$L" -ge 60 ] && OUT=$OUT LIMIT=$L bash benchmarks/runs/gdn32k_device.sh >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
