#!/bin/bash
# Session 35's last device call (one `run`, <= 4 min, a short table last; what an unstarted
# call would have run, cut to the device time left): the flow borrowing the local pieces'
# chunks over every span's rows (qwen3_5_joint.FLOW_BORROWS) and the scan's wide value blocks
# for steps of >= 16 sequences (ragged.scan_block_v):
# 1. compiled: test_flow_borrows (engine-cut pieces), the wide-block test, the joint layer;
# 2. rag at 16 seats (pic_off, fcfs) with --compose-cost 1 (its "compose program pipelined"
#    line: the composition goal as the engine runs it).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s35d_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s35d.txt
left() { echo $((${TOTAL:-230} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 75 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 4 \
  tests/test_flow_borrows.py tests/test_span_joint_layer.py \
  "tests/test_gated_delta_seq_scan.py::test_a_step_of_many_sequences_scans_wide_value_blocks_with_the_same_results" \
  > "$OUT/tests_s35d.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s35d.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s35d.txt" | cut -c1-200 | sort -u | head -6 >> "$R"
L=$(left); [ "$L" -gt 145 ] && L=145
[ "$L" -ge 80 ] && OUT=$OUT LIMIT=$L NAME=rag_s35d bash benchmarks/runs/rag16_device.sh >> "$R"
grep -E "compose program pipelined" "$OUT/rag_s35d.txt" | cut -c1-250 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
