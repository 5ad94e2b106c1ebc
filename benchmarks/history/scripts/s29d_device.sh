#!/bin/bash
# The last of session 29's device time (<= 3 min): compiled tests of the in-place chain kernel
# (whether span_maps.COMPOSE_IN_PLACE may default on) and of the decode forms, then the LM head
# alone in four forms (a 16-row prefill step ran it as a 0.71 ms cuBLAS kernel).
# usage: OUT=$OUT bash benchmarks/history/scripts/s29d_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s29d.txt
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 110 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 4 \
  tests/test_chain_in_place.py tests/test_chain_compose_kernel.py tests/test_decode_conv.py \
  > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-200 >> "$R"
timeout 50 python3 -m benchmarks.lm_head_forms --rows 1 8 16 64 --reps 20 > "$OUT/lm_head.txt" 2>&1
echo "lm_head_forms rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^(lm head|rows)" "$OUT/lm_head.txt" | cut -c1-150 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
