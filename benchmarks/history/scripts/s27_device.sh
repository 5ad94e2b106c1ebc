#!/bin/bash
# The next device call after session 26 (one `run`, <= 9.5 min, a short table last; raw files
# under $OUT): session 26's state re-measured on a host of normal speed (s26d's was ~2x slow),
# and where the reordered call's remaining time goes. 1. issue 29's span request, its reordered
# prefill and decode steps replayed and profiled (30 kernels each), split-K off as the A/B;
# 2. the optimized HLO of the prefill (t = 128) and decode steps, every kernel by the named scope
# it comes from (benchmarks/hlo_kernels.py -> $OUT/hlo_kernels.txt: what the decode step's ~417
# kernels are, layer by layer; the decode module kept); 3. rag at 16 seats. 7 files come back.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s27_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s27
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s27.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
if grep -q H200 "$R"; then  # compiled tests of the kernels changed since the last H200 run
  MINIPIC_COMPILED=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 8 \
    tests/test_paged_attention.py tests/test_paged_attention_decode.py \
    tests/test_gdn_decode_kernel.py > "$OUT/tests.txt" 2>&1
  echo "compiled tests (H200) rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
  grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-200 >> "$R"
fi
XLA_PYTHON_CLIENT_PREALLOCATE=true timeout 240 python3 -m benchmarks.cli hybrid-spans --steps \
  --sync-repeat --profile-top 30 --profile-forms RAGGED_SPLITS=0 \
  > "$OUT/hybrid_spans.txt" 2>&1
echo "hybrid-spans rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^(call|[a-i] )|goal|warm-up|^    (prefill|decode)|^profile-top|kernels, busy" \
  "$OUT/hybrid_spans.txt" | grep -v "^W1" | cut -c1-200 >> "$R"
L=$(left); [ "$L" -gt 150 ] && L=150
if [ "$L" -ge 80 ]; then
  OUT=$OUT DECODE=1 LIMIT=$L bash benchmarks/runs/step_hlo_device.sh >> "$R"
  head -14 "$OUT/hlo_kernels.txt" >> "$R" 2>/dev/null
  # at most 8 files come back: keep the smaller step module (the decode step's), not the run log
  rm -f "$OUT/dump_run.txt" $(ls -S "$OUT"/*after_optimizations.txt 2>/dev/null | head -1)
fi
L=$(left); [ "$L" -gt 120 ] && L=120
if [ "$L" -ge 80 ]; then
  OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
