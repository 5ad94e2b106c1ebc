#!/bin/bash
# Session 30's second device call (one `run`, <= 6 min, a short table last): 0. the decode
# step's optimized HLO, every kernel by named scope (benchmarks/hlo_kernels.py); 1. the compiled
# tests of s30's first call, named one by one (two failed there, unnamed: the run's 110 s
# timeout cut the summary); 2. rag at 16 seats again (its compose cost failed there: a NameError
# in span_compose_cost, fixed).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s30b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s30
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s30b.txt
left() { echo $((${TOTAL:-360} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
L=$(left); [ "$L" -gt 100 ] && L=100
if [ "$L" -ge 70 ]; then
  OUT=$OUT DECODE=1 LIMIT=$L bash benchmarks/runs/step_hlo_device.sh >> "$R"
  head -30 "$OUT/hlo_kernels.txt" >> "$R" 2>/dev/null
  rm -f "$OUT/dump_run.txt" $(ls -S "$OUT"/*after_optimizations.txt 2>/dev/null | head -1)
fi
MINIPIC_COMPILED=1 timeout 130 python3 -m pytest -v -p no:cacheprovider -o addopts= -rfE -n 4 \
  tests/test_chain_in_place.py tests/test_chain_compose_kernel.py tests/test_gdn_decode_kernel.py \
  tests/test_decode_conv.py > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "(FAILED|ERROR)" "$OUT/tests.txt" | cut -c1-240 | head -20 >> "$R"
grep -E "^E  " "$OUT/tests.txt" | cut -c1-200 | head -20 >> "$R"
L=$(left); [ "$L" -gt 140 ] && L=140
OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
