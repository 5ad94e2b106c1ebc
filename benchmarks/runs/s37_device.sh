#!/bin/bash
# The next session's first device call (one `run`, <= 9.5 min, a short table last): session 36's
# forms built after its last call, off until compiled and timed:
#   decode_rows.ROWS_IN_KERNEL  the decode kernel reads each one-row sequence's row itself (no
#                               five [S] gathers a GDN layer) and leaves the others untouched;
#   qwen3_5_joint.ONE_ROWS      a span step's joint stream without its one-row flow sequences;
#   span_maps.STORE_SMALL_STACKED  the span-map store's tails and zero flags one scatter each.
# 1. compiled: tests/test_one_rows_in_place.py (all), test_gdn_decode_kernel.py;
# 2. rag's step shape (`span_step_work --layout long`), plain and warm/4: new / rows_in_kernel
#    / span_one_rows / span_one_rows_ik / small_stacked;
# 3. rag at 16 seats today and with all three on, twice each (A B A B: a process's first rag run
#    was slow for both configurations in s36d);
# 4. with the time left, the 1,024-token plain step's optimized module (step_hlo_device.sh, the
#    engine's fused weights): that no wrapped_concatenate is left (s36c's 66, ~0.6 ms a step, came
#    from span_step_work's unfused weights, fused since).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s37_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s37.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 4 \
  tests/test_one_rows_in_place.py tests/test_gdn_decode_kernel.py > "$OUT/tests_s37.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s37.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s37.txt" | cut -c1-200 | sort -u | head -8 >> "$R"
timeout 170 python3 -m benchmarks.span_step_work --time qwen3_5_0_8b --dtype bfloat16 --reps 7 \
  --layout long --variants plain warm/4 --forms new rows_in_kernel span_one_rows \
  span_one_rows_ik small_stacked --profile 12 > "$OUT/steps_s37.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps_s37.txt" | cut -c1-150 >> "$R"
ON=ONE_ROWS=1,ROWS_IN_KERNEL=1,STORE_SMALL_STACKED=1
for i in 1 2; do
  for form in "" $ON; do
    L=$(left); L=$((L - 10)); [ "$L" -gt 75 ] && L=75
    name=rag_today_$i; [ -n "$form" ] && name=rag_on_$i
    [ "$L" -ge 60 ] && OUT=$OUT LIMIT=$L NAME=$name COMPOSE=0 FORM=$form \
      bash benchmarks/runs/rag16_device.sh >> "$R"
  done
done
L=$(left); [ "$L" -gt 100 ] && L=100
[ "$L" -ge 60 ] && OUT=$OUT/hlo TOKENS=1024 LIMIT=$L bash benchmarks/runs/step_hlo_device.sh >> "$R"
grep -E "wrapped_concatenate|concatenate" "$OUT/hlo/hlo_kernels.txt" 2>/dev/null | head -6 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
