#!/bin/bash
# Session 29's first device call (one `run` on an H100 or H200, <= 9.7 min, a short table last):
# 1. compiled tests: the chain kernel in place on the state cache (new: the compose program as one
#    kernel, tests/test_chain_in_place.py), the chain kernel, and sessions 26-28's GDN kernels;
# 2. rag at 16 seats (the compose program profiled: before, 53 kernels / 1.05 ms = 11.05% of its
#    warm step on an H100 in s28b);
# 3. the decode step's kernels by named scope (step_hlo_device.sh DECODE=1: what a decode step's
#    ~416 kernels are, for the decode work of issue 29's reordered goal);
# 4. the step variants at rag's 1,024 tokens x 16 seats: today's form against the in-kernel stream
#    and the stacked conv gather (s29_device.sh's part 2), if time is left.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s29a_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s29
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s29a.txt
left() { echo $((${TOTAL:-570} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 4 \
  tests/test_chain_in_place.py tests/test_chain_compose_kernel.py tests/test_state_rows.py \
  tests/test_stream_rows.py tests/test_gated_delta_seq_scan.py tests/test_span_joint_layer.py \
  tests/test_gated_delta_breaks.py > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-200 >> "$R"
L=$(left); [ "$L" -gt 150 ] && L=150
OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
OUT=$OUT DECODE=1 LIMIT=100 bash benchmarks/runs/step_hlo_device.sh >> "$R"
head -3 "$OUT/hlo_kernels.txt" >> "$R" 2>/dev/null
L=$(left)
[ "$L" -ge 100 ] && timeout $((L - 10)) python3 -m benchmarks.span_step_work --time qwen3_5_0_8b \
  --dtype bfloat16 --reps 9 --variants plain warm/0 --forms new stream_in_kernel conv_stacked \
  --profile 12 > "$OUT/steps.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps.txt" >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
