#!/bin/bash
# The next device call after session 30 (one `run` on an H100 or H200, <= 9.7 min, a short
# table last; raw files under $OUT, at most 8 come back):
# 1. the compiled test that failed in s30b, alone, with its error text
#    (test_engine_decode_steps_step_states_in_place, both forms);
# 2. compiled tests of session 30's kernels: the scan writing its finals in place
#    (test_state_rows.py, test_finals_in_place.py), the decode kernel reading its gates in
#    the projection (test_decode_conv.py), the page-zeroing kernel in a NaN-poisoned engine
#    (test_page_zeroing.py; the compose program's in-place kernel passed on the H100 in s30b);
# 3. the 64-seat decode step: today's vs DECODE_GATES_IN_PROJ=1 (-54 copy kernels expected);
#    the t = 128 prefill: today's vs GDN_FINALS_IN_PLACE=1; both vs ZERO_KERNEL=1 (the fresh
#    pages zeroed by one kernel, not 12 scatters); one process, profiled;
# 4. rag at 16 seats (its compose program in both forms: the composition's share of a step).
# s31b_device.sh: rag's 1,024-token steps with finals_in_place / pad_logits, the head in its
# step form, the span request.
# Then decide GDN_FINALS_IN_PLACE, DECODE_GATES_IN_PROJ, ZERO_KERNEL and PAD_LOGITS_ROWS (on
# where faster and the compiled tests pass).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s31_device.sh
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
MINIPIC_COMPILED=1 MINIPIC_RUN_SLOW=1 timeout 140 python3 -m pytest -v -p no:cacheprovider -o addopts= -rfE -n 4 \
  tests/test_state_rows.py tests/test_finals_in_place.py tests/test_decode_conv.py \
  tests/test_page_zeroing.py -k "finals or gates or kernel" > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt" | cut -c1-120)" >> "$R"
grep -E "(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-200 | sort -u | head -12 >> "$R"
timeout 150 python3 -m benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 \
  --tokens 128 --ckpt 1 --decode --reps 9 --profile 6 \
  --forms "" DECODE_GATES_IN_PROJ=1,GDN_FINALS_IN_PLACE=1 ZERO_KERNEL=1 > "$OUT/decode_ab.txt" 2>&1
echo "decode / prefill A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^live_prerotate|^time |^profile (decode|prefill) [^|]*:" "$OUT/decode_ab.txt" | cut -c1-170 >> "$R"
L=$(left); [ "$L" -gt 140 ] && L=140
[ "$L" -ge 90 ] && OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
