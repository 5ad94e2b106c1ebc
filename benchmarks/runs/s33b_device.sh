#!/bin/bash
# Session 33's second device call (one `run`, <= 9 min, a short table last), after the first
# (s33_device.sh) turned the captures' products by a scan on and found a race in the finals form:
# 1. compiled: the race-free finals form (carried finals scattered after the kernel; programs
#    run last first on CPU) and the transition scan, bit for bit / within summation order;
# 2. the warm step at rag's 1,024 tokens x 16 seats, today (products by a scan) against today +
#    FINALS_IN_PLACE (`span_finals`), one process;
# 3. rag at 16 seats: pic_off and fcfs today, then fcfs with FINALS_IN_PLACE=1 (the engine now
#    takes it: its span steps' decode is undecided);
# 4. session 32's checkpoint-store A/B (the 64-seat 128 / 1,024-token prefill, the rows stacked
#    and layer by layer, CHECKPOINTS_STACKED=0), alternated twice, if time is left.
# Turn FINALS_IN_PLACE on if (1) passes and (2), (3) show it faster.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s33b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s33
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s33b.txt
left() { echo $((${TOTAL:-540} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 110 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 3 \
  tests/test_span_finals_in_place.py tests/test_transition_scan.py > "$OUT/tests_s33b.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s33b.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s33b.txt" | cut -c1-200 | sort -u | head -8 >> "$R"
L=$(left); [ "$L" -gt 120 ] && L=120
[ "$L" -ge 60 ] && timeout $L python3 -m benchmarks.span_step_work --time qwen3_5_0_8b \
  --dtype bfloat16 --reps 9 --variants warm/4 warm/0 --forms new span_finals \
  --profile 8 > "$OUT/steps_s33b.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps_s33b.txt" | cut -c1-150 >> "$R"
L=$(left); [ "$L" -gt 130 ] && L=130
[ "$L" -ge 90 ] && OUT=$OUT LIMIT=$L NAME=rag_today COMPOSE=0 \
  bash benchmarks/runs/rag16_device.sh >> "$R"
L=$(left); [ "$L" -gt 80 ] && L=80
[ "$L" -ge 60 ] && OUT=$OUT LIMIT=$L NAME=rag_finals CONFIGS=fcfs COMPOSE=0 \
  FORM=FINALS_IN_PLACE=1 bash benchmarks/runs/rag16_device.sh >> "$R"
L=$(left); [ "$L" -gt 170 ] && L=170
[ "$L" -ge 80 ] && timeout $L python3 -m benchmarks.fixed_step_work --time --seats 64 \
  --max-model-len 25600 --tokens 128 1024 --ckpt 1 --reps 15 \
  --forms "" CHECKPOINTS_STACKED=0 "" CHECKPOINTS_STACKED=0 > "$OUT/ckpt_store_ab.txt" 2>&1
echo "checkpoint store A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^live_prerotate|^time " "$OUT/ckpt_store_ab.txt" | cut -c1-170 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
