#!/bin/bash
# Session 29's last device seconds: the per-sequence decode test compiled again (s29d: padded
# rows changed the last bits when T < S; now the rows form there), and the LM head's row padding
# with kernels and busy time (s29d: 8 / 16 rows 0.65 / 0.87 ms as stored, 0.36 / 0.37 padded to 64).
# usage: OUT=$OUT bash benchmarks/runs/s29e_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s29e.txt
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 40 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 4 \
  tests/test_decode_conv.py > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-200 >> "$R"
timeout 40 python3 -m benchmarks.lm_head_forms --rows 2 8 16 32 --reps 20 \
  --forms rows32 rows64 rows128 > "$OUT/lm_head.txt" 2>&1
echo "lm_head_forms rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^rows" "$OUT/lm_head.txt" | cut -c1-170 >> "$R"
cat "$R"
