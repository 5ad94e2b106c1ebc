#!/bin/bash
# Session 33's second device call, run as session 34's first (one `run`, <= 9 min, a short
# table last), after s33_device.sh turned the captures' products by a scan on and found a race
# in the span finals form; session 34 added the stream's gather by a kernel (stream_pack.py):
# 1. compiled: the race-free finals form (carried finals computed by the flow's own program),
#    the transition scan and the pack kernel, bit for bit / within summation order;
# 2. the steps at rag's 1,024 tokens x 16 seats (plain, warm/4, warm/0), today against
#    FINALS_IN_PLACE (`span_finals`), PACK_KERNEL (`pack_kernel`) and both (`pack_finals`);
# 3. rag at 16 seats, pic_off and fcfs, today and with PACK_KERNEL=1,FINALS_IN_PLACE=1 (both
#    configurations under the form: the plain steps pack too).
# Turn a switch on where (1) passes and (2), (3) show it faster.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s33b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s33
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s33b.txt
left() { echo $((${TOTAL:-540} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 110 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 3 \
  tests/test_span_finals_in_place.py tests/test_transition_scan.py tests/test_stream_pack.py \
  > "$OUT/tests_s33b.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s33b.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s33b.txt" | cut -c1-200 | sort -u | head -8 >> "$R"
L=$(left); [ "$L" -gt 150 ] && L=150
[ "$L" -ge 60 ] && timeout $L python3 -m benchmarks.span_step_work --time qwen3_5_0_8b \
  --dtype bfloat16 --reps 7 --variants plain warm/4 warm/0 \
  --forms new span_finals pack_kernel pack_finals --profile 30 > "$OUT/steps_s33b.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps_s33b.txt" | cut -c1-150 >> "$R"
L=$(left); [ "$L" -gt 130 ] && L=130
[ "$L" -ge 90 ] && OUT=$OUT LIMIT=$L NAME=rag_today COMPOSE=0 \
  bash benchmarks/runs/rag16_device.sh >> "$R"
L=$(left); [ "$L" -gt 130 ] && L=130
[ "$L" -ge 90 ] && OUT=$OUT LIMIT=$L NAME=rag_pack_finals COMPOSE=0 \
  FORM=PACK_KERNEL=1,FINALS_IN_PLACE=1 bash benchmarks/runs/rag16_device.sh >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
