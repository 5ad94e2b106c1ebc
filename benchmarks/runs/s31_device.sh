#!/bin/bash
# The next device call after session 30 (one `run` on an H100 or H200, <= 9.7 min, a short
# table last; raw files under $OUT, at most 8 come back):
# 1. the compiled test that failed in s30b, alone, with its error text
#    (test_engine_decode_steps_step_states_in_place, both forms);
# 2. compiled tests of session 30's kernels: the scan writing its finals in place
#    (test_state_rows.py, test_finals_in_place.py) and the decode kernel reading its gates in
#    the projection (test_decode_conv.py), the compose program's in place kernel;
# 3. the 64-seat decode step: today's vs DECODE_GATES_IN_PROJ=1 (-54 copy kernels expected);
#    the t = 128 prefill: today's vs GDN_FINALS_IN_PLACE=1 (one process, profiled);
# 4. rag's 1,024-token plain and warm steps: new / finals_in_place / pad_logits (the 16-row
#    head, a 0.71 ms cuBLAS kernel in the step); the head alone in the step's own form;
# 5. rag at 16 seats (its compose program in both forms: the composition's share of a step).
# Then decide GDN_FINALS_IN_PLACE, DECODE_GATES_IN_PROJ and PAD_LOGITS_ROWS (on where faster).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s31_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s31
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s31.txt
left() { echo $((${TOTAL:-570} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 90 python3 -m pytest -x -q -p no:cacheprovider -o addopts= \
  tests/test_gdn_decode_kernel.py -k test_engine_decode_steps_step_states_in_place \
  > "$OUT/tests_failed.txt" 2>&1
echo "the s30b failure alone rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^E  |passed|failed" "$OUT/tests_failed.txt" | cut -c1-220 | head -12 >> "$R"
MINIPIC_COMPILED=1 timeout 150 python3 -m pytest -v -p no:cacheprovider -o addopts= -rfE -n 4 \
  tests/test_state_rows.py tests/test_finals_in_place.py tests/test_decode_conv.py \
  tests/test_chain_in_place.py > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt" | cut -c1-120)" >> "$R"
grep -E "(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-200 | sort -u | head -12 >> "$R"
timeout 130 python3 -m benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 \
  --tokens 128 --ckpt 1 --decode --reps 9 --profile 6 \
  --forms "" DECODE_GATES_IN_PROJ=1,GDN_FINALS_IN_PLACE=1 > "$OUT/decode_ab.txt" 2>&1
echo "decode / prefill A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^live_prerotate|^time |^profile (decode|prefill) [^|]*:" "$OUT/decode_ab.txt" | cut -c1-170 >> "$R"
timeout 110 python3 -m benchmarks.span_step_work --time qwen3_5_0_8b --dtype bfloat16 --reps 9 \
  --variants plain warm/0 --forms new finals_in_place pad_logits --profile 6 > "$OUT/steps.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy|nvjet" "$OUT/steps.txt" | cut -c1-150 >> "$R"
timeout 40 python3 -m benchmarks.lm_head_forms --rows 16 --reps 20 --forms in_step \
  in_step_barrier rows64 > "$OUT/lm_head.txt" 2>&1
echo "lm_head_forms rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^rows" "$OUT/lm_head.txt" | cut -c1-150 >> "$R"
L=$(left); [ "$L" -gt 140 ] && L=140
[ "$L" -ge 90 ] && OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
