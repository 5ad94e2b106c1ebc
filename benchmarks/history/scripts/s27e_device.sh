#!/bin/bash
# Session 27's fifth device call (one `run`, ~6 min, a short table last): 1. compiled tests of the
# in-place state scan (its compiled bar: float32 summation order); 2. the in-place initial states
# A/B in one process: the step variants at rag's 1,024 tokens x 16 seats, each traced with the
# states read in place (`new`) and with the table built first (`built_states`), profiled.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s27e_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s27
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s27e.txt
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 100 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 4 \
  tests/test_state_rows.py tests/test_gated_delta_seq_scan.py > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-200 >> "$R"
L=$((${TOTAL:-400} - SECONDS + T0 - 10))
timeout $L python3 -m benchmarks.span_step_work --time qwen3_5_0_8b --dtype bfloat16 --reps 9 \
  --variants plain warm/0 warm/4 --forms new built_states --profile 14 \
  > "$OUT/state_rows_ab.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -v "^W1\|^I1\|Warning\|warn" "$OUT/state_rows_ab.txt" | tail -40 | cut -c1-200 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
