#!/bin/bash
# Session 39's second call (one `run`, <= 9.5 min, any card): rag at 16 seats once (issue 29's
# goal, spans >= 1.0x prefix caching on multi and zipf, with the span capture policy: a second
# run beside session 38's), then issue 29's span request after the planner's sums stopped
# calling BLAS (session 39's first call: the engine's admission profile had placement.compress
# at 1.4 ms a call, np.dot waking OpenBLAS's threads), its admission profiled again.
# On an H200 it runs issue 28's first run instead (issue28_h200.sh 1: the cached-span TTFT
# through LLM.generate, the exact XLA limit at 40,960).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s39b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s39b.txt
if nvidia-smi -L 2>/dev/null | grep -q H200; then
  OUT=$OUT bash benchmarks/runs/issue28_h200.sh 1; exit
fi
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
OUT=$OUT LIMIT=110 NAME=rag COMPOSE=0 CONFIGS="pic_off fcfs" \
  bash benchmarks/runs/rag16_device.sh | grep " rc=" >> "$R"
grep -E "hit rate|span maps" "$OUT/rag.txt" \
  | sed -E "s/, [0-9.]+ total tokens.*hit rate/, hit rate/; s/TTFT.*//" | cut -c1-150 >> "$R"
echo "== rag t=$((SECONDS-T0)) s" >> "$R"
OUT=$OUT LIMIT=$(left) EXTRA="--admit-profile $OUT/admit_profile.txt" \
  bash benchmarks/runs/span_request_device.sh >> "$R"
grep -E "function calls|tottime|\.py" "$OUT/admit_profile.txt" | head -12 | cut -c1-140 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
