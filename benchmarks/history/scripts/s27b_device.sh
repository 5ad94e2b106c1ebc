#!/bin/bash
# Session 27's second device call (one `run`, <= 9.5 min, a short table last; raw files under
# $OUT): 1. issue 29's span request with every call a-f under a jax.profiler trace, its 25
# costliest host events by name (`hybrid-spans --host-trace 25`): what a program's first real use
# after the warm-up pays (s27: +3-6 ms of dispatch per program, e.g. c's prefill 5.72 ms vs e's
# 0.89) that its repeat does not; 2. issue 28's cached-span TTFT at HEAD (ttft_next_device.sh,
# the 8B shape, what is left of the time).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s27b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s27
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s27b.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
XLA_PYTHON_CLIENT_PREALLOCATE=true timeout 230 python3 -m benchmarks.cli hybrid-spans --steps \
  --host-trace 25 --json "$OUT/hybrid_spans_trace.json" > "$OUT/hybrid_spans_trace.txt" 2>&1
echo "hybrid-spans --host-trace rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^(call|[a-g] )|goal|warm-up [0-9]|^    (prefill|decode)" "$OUT/hybrid_spans_trace.txt" \
  | grep -v "^W1" | cut -c1-150 >> "$R"
L=$(left); [ "$L" -gt 300 ] && L=300
if [ "$L" -ge 200 ]; then
  OUT=$OUT/ttft LIMIT_XLA=$((L - 30)) bash benchmarks/runs/ttft_next_device.sh > "$OUT/ttft.txt" 2>&1
  echo "ttft rc=$? t=$((SECONDS-T0)) s" >> "$R"
  tail -14 "$OUT/ttft/ttft_next.txt" | cut -c1-220 >> "$R"
  cp "$OUT/ttft/ttft_xla/rag_bench.json" "$OUT/ttft_rag_bench.json" 2>/dev/null
  rm -rf "$OUT/ttft/ttft_xla"
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
