#!/bin/bash
# Session 36's last device call (one `run`, <= 7.5 min, a short table last): a plain prefill
# step's one-row sequences stepped by the GDN decode kernel (qwen3_5.ONE_ROWS_IN_PLACE, new, off):
# 1. its tests compiled (the decode kernel after the chunked pass, bit for bit elsewhere);
# 2. rag's plain step shape (one long prefill beside 15 one-row sequences: `span_step_work
#    --layout long`), today's form and the switch, twice each (A B A B);
# 3. rag at 16 seats today and with the switch (both configurations; no composition timing).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s36d_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s36d.txt
left() { echo $((${TOTAL:-420} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 100 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE \
  tests/test_one_rows_in_place.py > "$OUT/tests_s36d.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s36d.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s36d.txt" | cut -c1-200 | sort -u | head -8 >> "$R"
timeout 130 python3 -m benchmarks.span_step_work --time qwen3_5_0_8b --dtype bfloat16 --reps 7 \
  --layout long --variants plain --forms new one_rows new one_rows --profile 12 \
  > "$OUT/steps_s36d.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps_s36d.txt" | cut -c1-150 >> "$R"
for form in "" ONE_ROWS_IN_PLACE=1; do
  L=$(left); L=$((L - 10)); [ "$L" -gt 110 ] && L=110
  name=rag_today; [ -n "$form" ] && name=rag_one_rows
  [ "$L" -ge 70 ] && OUT=$OUT LIMIT=$L NAME=$name COMPOSE=0 FORM=$form \
    bash benchmarks/runs/rag16_device.sh >> "$R"
done
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
