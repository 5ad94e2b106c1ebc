#!/bin/bash
# Session 35's second device call (one `run`, <= 8 min, a short table last), the flow reading
# its captured pieces' chunks (qwen3_5_joint.FLOW_BORROWS) on:
# 1. compiled: test_flow_borrows (the cut stream bit for bit, the flow's checkpoints against
#    the recurrence), the joint layer / finals-in-place tests, the kernels whose code changed
#    (the scan's chunk_src operand, the intra / output / pack kernels' live chunks), and the
#    hybrid span engine tests (FLOW_BORROWS on through LLM.generate);
# 2. span_step_work at rag's 1,024 tokens x 16 seats, warm/4 and plain: new / borrow_off / bv64;
# 3. rag at 16 seats (pic_off, fcfs) with today's defaults.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s35b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s35b.txt
left() { echo $((${TOTAL:-470} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 MINIPIC_RUN_SLOW=1 timeout 170 python3 -m pytest -q -p no:cacheprovider \
  -o addopts= -rfE -n 6 tests/test_flow_borrows.py tests/test_span_joint_layer.py \
  tests/test_span_finals_in_place.py tests/test_stream_pack.py tests/test_transition_scan.py \
  tests/test_gated_delta_seq_scan.py tests/test_gated_delta_breaks.py \
  tests/test_engine_hybrid_spans.py tests/test_engine_span_forms.py > "$OUT/tests_s35b.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s35b.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s35b.txt" | cut -c1-200 | sort -u | head -10 >> "$R"
L=$(left); L=$((L - 150)); [ "$L" -gt 200 ] && L=200
F="new borrow_off"; [ "$L" -ge 150 ] && F="new borrow_off bv64"
[ "$L" -ge 60 ] && timeout $L python3 -m benchmarks.span_step_work --time qwen3_5_0_8b \
  --dtype bfloat16 --reps 5 --variants warm/4 plain --forms $F \
  --profile 30 > "$OUT/steps_s35b.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps_s35b.txt" | cut -c1-150 >> "$R"
L=$(left); [ "$L" -gt 150 ] && L=150
[ "$L" -ge 80 ] && OUT=$OUT LIMIT=$L NAME=rag_s35 bash benchmarks/runs/rag16_device.sh >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
