#!/bin/bash
# Session 33's device call (one `run`, <= 9.5 min, a short table last): the two span-step forms
# built this session, both off until this call.
# 1. compiled: the captures' products by a scan over their local chunks (TRANSITIONS_IN_STREAM=0,
#    transition_scan.py) and a span step's finals written by the scan (FINALS_IN_PLACE=1,
#    StateRows.final_rows), bit for bit against the forms before; with them the layer-by-layer
#    checkpoint store and the finals' bit-for-bit test (session 32's, owed);
# 2. rag's 1,024-token steps at 16 seats: warm/4, warm/0 and plain, today's against both forms
#    (`span_both`), one process, profiled (top 12);
# 3. rag at 16 seats, pic_off and fcfs today, then fcfs under both forms (--program-form): the
#    zipf / multi ratios (goal 1.0x), each configuration a process of its own.
# If (1) fails, leave both switches off. If (2) and (3) show both forms faster, turn them on
# (qwen3_5_joint.TRANSITIONS_IN_STREAM = False, FINALS_IN_PLACE = True).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s33_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s33
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s33.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 130 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 3 \
  tests/test_transition_scan.py tests/test_span_finals_in_place.py \
  tests/test_checkpoint_store_layers.py \
  "tests/test_finals_in_place.py::test_finals_in_place_is_the_scatter_bit_for_bit" \
  > "$OUT/tests_s33.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s33.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s33.txt" | cut -c1-200 | sort -u | head -8 >> "$R"
L=$(left); [ "$L" -gt 170 ] && L=170
[ "$L" -ge 60 ] && timeout $L python3 -m benchmarks.span_step_work --time qwen3_5_0_8b \
  --dtype bfloat16 --reps 9 --variants warm/4 warm/0 plain --forms new span_both \
  --profile 12 > "$OUT/steps_s33.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps_s33.txt" | cut -c1-150 >> "$R"
RAG="--model qwen3_5_0_8b --dtype bfloat16 --num-requests 24 --passage-tokens 128
  --max-num-batched-tokens 1024 --min-token-bucket 1024 --max-num-seqs 16 --max-model-len 4096
  --num-kv-blocks 4096 --workloads multi zipf --modes offline --max-tokens 8"
L=$(left); [ "$L" -gt 150 ] && L=150
[ "$L" -ge 90 ] && timeout $L python3 -m benchmarks.cli rag $RAG --configs pic_off fcfs \
  --out "$OUT/rag_today" > "$OUT/rag_today.txt" 2>&1
echo "rag today rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "requests/s" "$OUT/rag_today.txt" | cut -c1-200 >> "$R"
L=$(left)
[ "$L" -ge 70 ] && timeout $L python3 -m benchmarks.cli rag $RAG --configs fcfs \
  --program-form TRANSITIONS_IN_STREAM=0,FINALS_IN_PLACE=1 --out "$OUT/rag_both" \
  > "$OUT/rag_both.txt" 2>&1
echo "rag span_both rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "requests/s" "$OUT/rag_both.txt" | cut -c1-200 >> "$R"
rm -f "$OUT"/rag_*/rag_bench.png
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
