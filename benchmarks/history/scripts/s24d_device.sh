#!/bin/bash
# Session 24's last device call (one `run`, <= 6 min): the compiled tests of the compose program's
# fused restore (tests/test_engine_hybrid_spans.py: a resume right before skipped spans, against
# the float64 reference) and the small sequence bucket, then rag at 16 seats with the compose
# program replayed and profiled (--compose-cost 1: its share of the step, kernels; the call
# before: 2.08 ms, 87 kernels, 16 chain rows for 5 chains).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s24d_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s24
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s24d.txt
left() { echo $((${TOTAL:-330} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 8 \
  tests/test_engine_hybrid_spans.py tests/test_small_seq_bucket.py tests/test_span_maps.py \
  tests/test_chain_compose_kernel.py > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-220 >> "$R"
L=$(left); [ "$L" -gt 170 ] && L=170
if [ "$L" -ge 70 ]; then
  OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
