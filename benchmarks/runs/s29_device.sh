#!/bin/bash
# The next device call after session 28 (one `run` on an H100 or H200, <= 9.7 min, a short table
# last): 1. compiled tests of sessions 26-28's GDN kernels (state rows, stream rows, the
# sequence scan, the joint layer, the breaks); 2. the step variants at rag's 1,024 tokens x 16
# seats, today's form against the in-kernel stream (s28: busy lower, wall higher in the warm
# step; why?) and the plain step's conv taps as one stacked gather each (CONV_STACKED_GATHER:
# the span steps' form, cheaper there), profiled; 3. issue 29's span request with its decode and reordered prefill
# profiled (the goal lines print before the profile since `4e55c13`; the warm-up took 230 s on
# a fresh H100 in s28); 4. rag at 16 seats if time is left.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s29_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s29
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s29.txt
left() { echo $((${TOTAL:-570} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 4 \
  tests/test_state_rows.py tests/test_stream_rows.py tests/test_gated_delta_seq_scan.py \
  tests/test_span_joint_layer.py tests/test_gated_delta_breaks.py > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-200 >> "$R"
timeout 170 python3 -m benchmarks.span_step_work --time qwen3_5_0_8b --dtype bfloat16 --reps 9 \
  --variants plain warm/0 --forms new stream_in_kernel conv_stacked --profile 12 \
  > "$OUT/steps.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps.txt" >> "$R"
L=$(left); [ "$L" -gt 330 ] && L=330
OUT=$OUT LIMIT=$L EXTRA="--profile-top 15" bash benchmarks/runs/span_request_device.sh >> "$R"
grep -E "^profile" "$OUT/hybrid_spans.txt" | cut -c1-160 >> "$R"
L=$(left); [ "$L" -gt 110 ] && L=110
[ "$L" -ge 90 ] && OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
