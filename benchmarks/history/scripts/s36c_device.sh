#!/bin/bash
# Session 36's third device call (one `run`, <= 8.5 min, a short table last):
# 1. the hybrid decode step's two undecided switches (s31: untimed 2.15 vs 1.88 ms, first-to-last
#    2.26 vs 2.42 under the profiler), each an engine, today's form first and last (A B C D A):
#    the decode kernel reading a, b, z in the fused projection (DECODE_GATES_IN_PROJ, -54
#    kernels) and one page-zeroing kernel (ZERO_KERNEL, -11);
# 2. every kernel of rag's warm/4 and plain steps (`span_step_work --layout long --profile 400`):
#    where the capturing step's premium over a plain one goes (s36: 11.35 vs 9.18 ms, 880 vs 706
#    kernels; the top 20 name ~0.5 of its 1.94 ms of busy time).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s36c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s36c.txt
left() { echo $((${TOTAL:-480} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
timeout 280 python3 -m benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 \
  --tokens 128 --ckpt 1 --decode --reps 15 --profile 3 --forms "" DECODE_GATES_IN_PROJ=1 \
  ZERO_KERNEL=1 DECODE_GATES_IN_PROJ=1,ZERO_KERNEL=1 "" > "$OUT/decode_ab.txt" 2>&1
echo "decode A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^live|^time|^profile (decode|prefill) t=[0-9]+ s=[0-9]+:" "$OUT/decode_ab.txt" \
  | sed "s/time qwen3_5_0_8b seats=64 max_model_len=25600 caching=1 small_seq_bucket=8 fuse=1//" | cut -c1-160 >> "$R"
L=$(left); [ "$L" -gt 200 ] && L=200
[ "$L" -ge 60 ] && timeout $L python3 -m benchmarks.span_step_work --time qwen3_5_0_8b \
  --dtype bfloat16 --reps 5 --layout long --variants warm/4 plain --forms new \
  --profile 400 > "$OUT/steps_all_kernels.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps_all_kernels.txt" | cut -c1-150 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
