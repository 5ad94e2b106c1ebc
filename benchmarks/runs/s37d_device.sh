#!/bin/bash
# Session 37's last device minutes (one short `run`, ~2 min, any card): the row kernels
# compiled (MINIPIC_COMPILED=1 tests/test_row_matmul.py: the kernels against the XLA form, the
# tiny decode step per switch set, the Llama fixture's tokens), then the MLP alone, kernels vs
# XLA, at the widths of Qwen3.5-0.8B and Llama-3-8B with the time left.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s37d_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s37d.txt
left() { echo $((${TOTAL:-120} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 75 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE \
  tests/test_row_matmul.py > "$OUT/tests_s37d.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s37d.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s37d.txt" | cut -c1-200 | sort -u | head -8 >> "$R"
L=$(left); [ "$L" -ge 20 ] && timeout $L python3 -m benchmarks.row_matmul_bench --rows 8 64 \
  --iters 10 --reps 7 > "$OUT/mlp_ab.txt" 2>&1
echo "mlp A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "rows|device" "$OUT/mlp_ab.txt" | cut -c1-170 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
