#!/bin/bash
# Session 27's third device call (one `run`, <= 9.5 min, a short table last): the warm-up running
# each step variant twice (model_runner.FIRST_CALLS = 2: XLA instantiates a program's CUDA graphs
# on its second run) measured where it shows: 1. issue 29's span request (the first-use rows of
# calls a-c: s27 paid +3-6 ms of dispatch per program there; goals); 2. rag at 16 seats.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s27c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s27
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s27c.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
XLA_PYTHON_CLIENT_PREALLOCATE=true timeout 260 python3 -m benchmarks.cli hybrid-spans --steps \
  --sync-repeat --json "$OUT/hybrid_spans.json" > "$OUT/hybrid_spans.txt" 2>&1
echo "hybrid-spans rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^(call|[a-i] )|goal|warm-up [0-9]|^    (prefill|decode)" "$OUT/hybrid_spans.txt" \
  | grep -v "^W1" | cut -c1-150 >> "$R"
L=$(left); [ "$L" -gt 150 ] && L=150
if [ "$L" -ge 80 ]; then
  OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
