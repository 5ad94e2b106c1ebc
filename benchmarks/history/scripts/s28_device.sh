#!/bin/bash
# The next device call after session 27 (one `run`, <= 9.5 min, a short table last). Before it:
#   rm -rf old_tree && mkdir old_tree && git archive 7ce3acd | tar -x -C old_tree
# (the tree before the span-map pool's store barrier; untracked, it travels with the tree; delete
# it after). 1. compiled tests of session 27's kernels (the in-place states, the stream read
# through its source rows: stream_rows.STREAM_IN_KERNEL, off until this call says it compiles
# and pays); 2. the warm span steps before / after the store barrier (XLA copied the pool's A
# and B in every warm step: memcpy128 x 2, ~0.4 ms on an H100), one process each, same card,
# and in-process the stream form and the conv's A/B (`--forms new stream_in_kernel conv_reduce`:
# the causal conv as summed taps, qwen3_5_gdn.CONV_ROW_SUM, against the einsum over the window's
# minor axis, a reduce fusion of ~40 us a layer on an H100; profiled); 3. issue 29's
# span request (goals; the first-use rows should stay flat, s27d; its decode step profiled: the
# GDN decode's output mapped to rows by a gather after the projection, not a scatter: 417 ->
# ~399 kernels expected) and rag at 16 seats.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s28_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s28
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s28.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 4 \
  tests/test_state_rows.py tests/test_stream_rows.py tests/test_gated_delta_seq_scan.py \
  tests/test_span_joint_layer.py tests/test_gated_delta_breaks.py \
  > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-200 >> "$R"
ARGS="--time qwen3_5_0_8b --dtype bfloat16 --reps 9 --variants plain warm/0 warm/4"
if [ -d old_tree ]; then
  (cd old_tree && PYTHONPATH=$PWD timeout 90 python3 -m benchmarks.span_step_work $ARGS 2>&1 \
    | grep "^time" | sed 's/^/before 7ce3acd: /') >> "$R"
fi
timeout 230 python3 -m benchmarks.span_step_work $ARGS --forms new stream_in_kernel conv_reduce \
  --profile 10 \
  > "$OUT/steps.txt" 2>&1
grep -E "^time|memcpy|kernels, busy" "$OUT/steps.txt" | sed 's/^/after: /' >> "$R"
OUT=$OUT LIMIT=260 EXTRA="--profile-top 12" bash benchmarks/runs/span_request_device.sh >> "$R"
L=$(left); [ "$L" -gt 110 ] && L=110
[ "$L" -ge 80 ] && OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
