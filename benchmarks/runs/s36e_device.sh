#!/bin/bash
# Session 36's leftover device time (one short `run`): the two forms built after s36d, compiled
# with their tests: decode_rows.ROWS_IN_KERNEL (the decode kernel reading each sequence's row in
# the step's arrays, bit for bit the gathered form) and qwen3_5_joint.ONE_ROWS (a span step's
# joint stream without its one-row flow sequences, the decode kernel stepping them after it).
# usage: OUT=$OUT [LIMIT=seconds] bash benchmarks/runs/s36e_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s36e.txt
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout ${LIMIT:-100} python3 -m pytest -q -p no:cacheprovider -o addopts= \
  -rfE tests/test_one_rows_in_place.py -k "rows_itself or joint_stream" \
  > "$OUT/tests_s36e.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s36e.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s36e.txt" | cut -c1-200 | sort -u | head -8 >> "$R"
cat "$R"
