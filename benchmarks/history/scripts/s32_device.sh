#!/bin/bash
# The first device call of session 32 (one `run`, <= 9.5 min, a short table last):
# 1. the compiled engine tests s31 owed (GDN_FINALS_IN_PLACE, on since session 31, and
#    DECODE_GATES_IN_PROJ through LLM.generate; the in-place decode engine steps), the tiny
#    engine's default pool on the GPU after step_temps.VIEWS (s31: 2 blocks), and compiled: the
#    finals' bit-for-bit test (each form now traced anew) and the layer-by-layer checkpoint store;
# 2. the 64-seat 128- and 1,024-token prefill steps with the checkpoint pool, the rows stored
#    stacked (today) and layer by layer (checkpoint_pool.CHECKPOINTS_STACKED=0), alternated twice;
# 3. rag at 16 seats with the finals in place and the compose program's pipelined cost (the
#    composition goal: compose + step dispatched ahead against the step alone);
# 4. (session 33, was the decode A/B) the warm span step with 4 captures, today's against the
#    transitions by a scan + span finals in place (`span_both`), alternated twice; session 33's
#    compiled tests of those two kernels ride with (1).
# If (1) fails on the finals, set qwen3_5.GDN_FINALS_IN_PLACE = False again.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s32_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s32
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s32.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
OUT=$OUT bash benchmarks/history/scripts/s31d_device.sh > /dev/null 2>&1
cat "$OUT/s31d.txt" > "$R"
MINIPIC_COMPILED=1 timeout 140 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE \
  tests/test_checkpoint_store_layers.py "tests/test_finals_in_place.py::test_finals_in_place_is_the_scatter_bit_for_bit" \
  tests/test_transition_scan.py tests/test_span_finals_in_place.py > "$OUT/tests_store.txt" 2>&1
echo "compiled store + finals tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_store.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_store.txt" | cut -c1-200 | sort -u | head -8 >> "$R"
L=$(left); [ "$L" -gt 170 ] && L=170
[ "$L" -ge 80 ] && timeout $L python3 -m benchmarks.fixed_step_work --time --seats 64 \
  --max-model-len 25600 --tokens 128 1024 --ckpt 1 --reps 15 --profile 4 \
  --forms "" CHECKPOINTS_STACKED=0 "" CHECKPOINTS_STACKED=0 > "$OUT/ckpt_store_ab.txt" 2>&1
echo "checkpoint store A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^live_prerotate|^time |^profile prefill [^|]*:" "$OUT/ckpt_store_ab.txt" | cut -c1-170 >> "$R"
L=$(left); [ "$L" -gt 150 ] && L=150
[ "$L" -ge 90 ] && OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
L=$(left); [ "$L" -gt 150 ] && L=150
[ "$L" -ge 60 ] && timeout $L python3 -m benchmarks.span_step_work --time qwen3_5_0_8b \
  --dtype bfloat16 --reps 9 --variants warm/4 --forms new span_both new span_both \
  > "$OUT/span_both_ab.txt" 2>&1
echo "span_both A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time " "$OUT/span_both_ab.txt" | cut -c1-150 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
