#!/bin/bash
# The next session's first call (one `run`, <= 9.5 min, any card; written in session 41).
# On an H200: issue 28's first run (issue28_h200.sh 1). Elsewhere, issue 29's reordered span
# request, which session 41 found device-bound (H100: of call e's 22.5 ms, 18.8 busy; a decode
# step 383 kernels at 1.45 ms against a ~0.45 ms weight-read floor; the prefill + compose step
# 6.8 ms for 121 tokens): the span request without the warm-up on an 8,192-block pool, then its
# reordered prefill step and a decode step replayed alone with their 25 costliest kernels
# (`--profile-top 25`), the list a fused decode layer and a cheaper reordered step start from.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s42_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s42.txt
if nvidia-smi -L 2>/dev/null | grep -q H200; then
  OUT=$OUT bash benchmarks/runs/issue28_h200.sh 1; exit
fi
nvidia-smi -L > "$R" 2>/dev/null
t=$SECONDS
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $((${TOTAL:-560} - SECONDS + T0 - 10)) python3 -m \
  benchmarks.cli hybrid-spans --no-warmup --num-kv-blocks 8192 --profile-top 25 \
  --json "$OUT/hybrid_spans.json" > "$OUT/hybrid_spans.txt" 2>&1
echo "hybrid-spans --no-warmup --num-kv-blocks 8192 --profile-top 25 rc=$? ($((SECONDS - t)) s)" \
  >> "$R"
grep -E "^(call|[d-f] )|goal .*/|^    (prefill|decode)" "$OUT/hybrid_spans.txt" | grep -v "^W1" \
  | cut -c1-170 >> "$R"
grep -A28 -E "profile-top" "$OUT/hybrid_spans.txt" | grep -v "^W1" | cut -c1-170 | head -64 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
