#!/bin/bash
# Session 34's second device call (one `run`, <= 7.5 min, a short table last), after s33b's
# turned the span finals in place (FINALS_IN_PLACE) and the stream's gather by a kernel
# (stream_pack.PACK_KERNEL) on:
# 1. compiled, with both on: the hybrid span engine against the float64 reference (the engine
#    tests and test_engine_span_forms), and the engine tests owed since session 31
#    (s31d_device.sh's: GDN_FINALS_IN_PLACE, DECODE_GATES_IN_PROJ through LLM.generate, the
#    in-place decode steps);
# 2. the state scan's value block (ragged.SCAN_BLOCK_V: 16 today, from a 32K one-sequence sweep)
#    at rag's 1,024 tokens x 16 seats, plain and warm/4: 32 / 64 / 128 against today, and today
#    without the pack kernel; the 30 costliest kernels of each;
# 3. rag at 16 seats (pic_off, fcfs) with today's defaults and --compose-cost 1 (the compose
#    program's share of its step, pipelined as the engine runs it: the composition goal).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s34b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s34
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s34b.txt
left() { echo $((${TOTAL:-450} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 MINIPIC_RUN_SLOW=1 timeout 170 python3 -m pytest -q -p no:cacheprovider \
  -o addopts= -rfE -n 4 tests/test_engine_hybrid_spans.py tests/test_engine_span_forms.py \
  "tests/test_finals_in_place.py" "tests/test_gdn_decode_kernel.py" -k "engine or span" \
  > "$OUT/tests_s34b.txt" 2>&1
echo "compiled engine tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s34b.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s34b.txt" | cut -c1-200 | sort -u | head -8 >> "$R"
L=$(left); [ "$L" -gt 130 ] && L=130
[ "$L" -ge 60 ] && timeout $L python3 -m benchmarks.span_step_work --time qwen3_5_0_8b \
  --dtype bfloat16 --reps 7 --variants plain warm/4 --forms new bv32 bv64 bv128 pack_off \
  --profile 30 > "$OUT/steps_s34b.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps_s34b.txt" | cut -c1-150 >> "$R"
L=$(left); [ "$L" -gt 150 ] && L=150
[ "$L" -ge 80 ] && OUT=$OUT LIMIT=$L NAME=rag_s34 bash benchmarks/runs/rag16_device.sh >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
