#!/bin/bash
# The next session's first device call (one `run`, <= 9.5 min, a short table last; an H200 if
# one comes: issue 29's goals are the H200's): session 35's forms, untimed since their last
# change (the flow borrowing from runs of >= 64 span rows, qwen3_5_joint.BORROW_MIN_ROWS; the
# static bound two chunks a borrowed piece; the scan's block_v 64 for steps of >= 16 sequences):
# 1. compiled: test_flow_borrows, the wide-block and breaks tests (the borrowed chunks' kernels
#    are compiled on an H100 only so far);
# 2. rag's step shape (one long prefill beside 15 one-row sequences, `--layout long`), warm/4
#    and plain: new / borrow_off / bv16;
# 3. rag at 16 seats (pic_off, fcfs) with --compose-cost 1 (its pipelined composition line);
# 4. issue 29's span request (cold vs plain <= 1.3x, reordered vs cold, 0 compiles).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s36_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s36.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 MINIPIC_RUN_SLOW=1 timeout 90 python3 -m pytest -q -p no:cacheprovider \
  -o addopts= -rfE -n 4 tests/test_flow_borrows.py tests/test_gated_delta_seq_scan.py \
  tests/test_gated_delta_breaks.py > "$OUT/tests_s36.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s36.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s36.txt" | cut -c1-200 | sort -u | head -8 >> "$R"
L=$(left); L=$((L - 300)); [ "$L" -gt 170 ] && L=170
[ "$L" -ge 60 ] && timeout $L python3 -m benchmarks.span_step_work --time qwen3_5_0_8b \
  --dtype bfloat16 --reps 5 --layout long --variants warm/4 plain --forms new borrow_off bv16 \
  --profile 20 > "$OUT/steps_s36.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps_s36.txt" | cut -c1-150 >> "$R"
L=$(left); L=$((L - 150)); [ "$L" -gt 140 ] && L=140
[ "$L" -ge 80 ] && OUT=$OUT LIMIT=$L NAME=rag_s36 bash benchmarks/runs/rag16_device.sh >> "$R"
grep -E "compose program pipelined" "$OUT/rag_s36.txt" | cut -c1-250 >> "$R"
L=$(left); [ "$L" -gt 200 ] && L=200
[ "$L" -ge 120 ] && OUT=$OUT LIMIT=$L bash benchmarks/runs/span_request_device.sh >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
