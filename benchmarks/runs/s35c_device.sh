#!/bin/bash
# Session 35's third device call (one `run`, <= 7.5 min, a short table last), with the flow
# borrowing the local pieces' chunks over every span's rows (qwen3_5_joint.FLOW_BORROWS;
# captured pieces only compiled on an H100 in s35b) and the scan's wide value blocks for steps
# of >= 16 sequences
# (ragged.scan_block_v, from s35b's bv64 rows):
# 1. compiled: the wide-block rule's test and the scan's other tests, the breaks test (its XLA
#    form compared within float32 rounding on a GPU now), test_flow_borrows;
# 2. issue 29's span request (6 x 900-token spans: cold vs plain, reordered vs cold, 0 compiles);
# 3. rag at 16 seats (pic_off, fcfs) with --compose-cost 1 (the "compose program pipelined"
#    line: the composition goal as the engine runs it, dropped on a GPU before session 35).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s35c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s35c.txt
left() { echo $((${TOTAL:-420} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 MINIPIC_RUN_SLOW=1 timeout 90 python3 -m pytest -q -p no:cacheprovider \
  -o addopts= -rfE -n 4 tests/test_gated_delta_seq_scan.py tests/test_gated_delta_breaks.py \
  tests/test_flow_borrows.py > "$OUT/tests_s35c.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s35c.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s35c.txt" | cut -c1-200 | sort -u | head -8 >> "$R"
L=$(left); L=$((L - 150)); [ "$L" -gt 190 ] && L=190
[ "$L" -ge 100 ] && OUT=$OUT LIMIT=$L bash benchmarks/runs/span_request_device.sh >> "$R"
L=$(left); [ "$L" -gt 150 ] && L=150
[ "$L" -ge 80 ] && OUT=$OUT LIMIT=$L NAME=rag_s35c bash benchmarks/runs/rag16_device.sh >> "$R"
grep -E "compose program pipelined" "$OUT/rag_s35c.txt" | cut -c1-250 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
