#!/bin/bash
# The next session's first call (one `run`, <= 9.5 min, any card; written in session 39).
# On an H200: issue 28's first run (issue28_h200.sh 1: the cached-span TTFT through
# LLM.generate, the exact XLA limit at 40,960). Elsewhere: issue 29's span request with the
# planner's BLAS-free sums (session 39: the engine's admission 5.46 ms, 3.7 ms of it np.dot on
# OpenBLAS's threads), its admissions profiled and one more reordered call's device timeline
# (`--device-trace`: is a decode step 3.4 ms of kernels in the engine, against 1.97 replayed
# alone, or idle time?), then rag at 16 seats with 5 repeats a workload (the median reported).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s40_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s40.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
if nvidia-smi -L 2>/dev/null | grep -q H200; then
  OUT=$OUT bash benchmarks/runs/issue28_h200.sh 1; exit
fi
nvidia-smi -L > "$R" 2>/dev/null
OUT=$OUT LIMIT=$(($(left) - 120)) \
  EXTRA="--admit-profile $OUT/admit_profile.txt --device-trace" \
  bash benchmarks/runs/span_request_device.sh >> "$R"
echo "XLA remat warnings at the warm-up: $(grep -c "Can't reduce memory use" \
  "$OUT/hybrid_spans.txt") (session 39: 1 before the span steps counted in the pool's reserve)" \
  >> "$R"
grep -E "device timeline|  burst" "$OUT/hybrid_spans.txt" | head -12 >> "$R"
grep -E "function calls|tottime|\.py" "$OUT/admit_profile.txt" | head -10 | cut -c1-140 >> "$R"
L=$(left); [ "$L" -gt 110 ] && L=110
[ "$L" -ge 70 ] && OUT=$OUT LIMIT=$L NAME=rag COMPOSE=0 CONFIGS="pic_off fcfs" \
  bash benchmarks/runs/rag16_device.sh | grep -E " rc=|offline [0-9.]+x|repeats" >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
