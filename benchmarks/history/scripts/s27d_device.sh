#!/bin/bash
# Session 27's fourth device call (one `run`, <= 9.5 min, a short table last): 1. compiled tests
# of the changed GDN scan kernel (state_rows: initial states read in place; bound states in the
# kv order) and its neighbours; 2. issue 29's span request after the warm-up re-runs its steps
# last (XLA evicts every CUDA graph when it makes a program) and with the in-place states;
# 3. rag at 16 seats.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s27d_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s27
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s27d.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 8 \
  tests/test_state_rows.py tests/test_gated_delta_seq_scan.py tests/test_span_joint_layer.py \
  tests/test_span_joint_pass.py tests/test_gated_delta_span_passes.py > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-200 >> "$R"
XLA_PYTHON_CLIENT_PREALLOCATE=true timeout 250 python3 -m benchmarks.cli hybrid-spans --steps \
  --json "$OUT/hybrid_spans.json" > "$OUT/hybrid_spans.txt" 2>&1
echo "hybrid-spans rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^(call|[a-g] )|goal|warm-up [0-9]|^    (prefill|decode)" "$OUT/hybrid_spans.txt" \
  | grep -v "^W1" | cut -c1-150 >> "$R"
L=$(left); [ "$L" -gt 120 ] && L=120
if [ "$L" -ge 80 ]; then
  OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
